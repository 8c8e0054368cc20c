//! The files the command line writes: output paths and format checked before any work, and the
//! settings stored in each image.
use std::path::{Path, PathBuf};

use klein::fsutil::{replaced_file, MAX_FILE_NAME_BYTES};
use klein::stages::output::ImageFormat;

use crate::UsageError;

/// The JPEG quality without `--quality`.
const DEFAULT_JPEG_QUALITY: u8 = 90;

/// The files `--output` names for `n` images (`out.png`, or `out-1.png` ... `out-N.png`) and
/// their format, refused before any work when they could not be written once the images are made:
/// a directory (or a path ending in a separator), a missing or unwritable directory, an unknown
/// extension; and a JPEG quality given for a lossless format.
/// `flag` names the option in messages (`output`, `--preview`).
pub(crate) fn output_files(
    flag: &str,
    output: &Path,
    n: usize,
    jpeg_quality: Option<u8>,
) -> anyhow::Result<(Vec<PathBuf>, ImageFormat)> {
    let text = output.as_os_str().to_string_lossy();
    if output.is_dir() || text.ends_with(std::path::is_separator) || output.file_name().is_none() {
        let what = if output.is_dir() {
            "is a directory"
        } else {
            "names a directory (it ends with a separator)"
        };
        return Err(UsageError(format!(
            "{flag} {} {what}; give a file name such as {}",
            output.display(),
            output.join("klein.png").display()
        ))
        .into());
    }
    let format = ImageFormat::from_path(output, jpeg_quality.unwrap_or(DEFAULT_JPEG_QUALITY))?;
    if let (Some(quality), false) = (jpeg_quality, matches!(format, ImageFormat::Jpeg { .. })) {
        return Err(UsageError(format!(
            "--quality {quality} is for JPEG outputs, and {} is a lossless format; \
             drop --quality or name a .jpg file",
            output.display()
        ))
        .into());
    }
    if n > 1 && output.exists() && !output.is_file() {
        return Err(UsageError(format!(
            "{flag} {} is not a file, and {n} images need numbered files beside it \
             (NAME-1, NAME-2, ...); give a file name",
            output.display()
        ))
        .into());
    }
    let paths = output_paths(output, n);
    for path in &paths {
        // The name of the file written: a symbolic link's target, where the temporary file goes.
        let replaced = replaced_file(path);
        let name_bytes = replaced.file_name().map_or(0, |name| name.len());
        if name_bytes > MAX_FILE_NAME_BYTES {
            let through = if replaced == *path {
                String::new()
            } else {
                format!(" (the file its link leads to, {})", replaced.display())
            };
            return Err(UsageError(format!(
                "{flag} {}{through}: the file name is {name_bytes} bytes long; at most \
                 {MAX_FILE_NAME_BYTES} (a temporary file beside it is written first); give a \
                 shorter name",
                path.display()
            ))
            .into());
        }
        if path.is_dir() {
            return Err(UsageError(format!(
                "{flag} {} is a directory; give another file name",
                path.display()
            ))
            .into());
        }
        let parent = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if !parent.is_dir() {
            let why = if parent.exists() {
                "is not a directory; give a path inside a directory"
            } else {
                "does not exist; create it first"
            };
            return Err(UsageError(format!(
                "{flag} {}: {} {why}",
                path.display(),
                parent.display()
            ))
            .into());
        }
        check_writable(&format!("{flag} {}", path.display()), path)?;
    }
    Ok((paths, format))
}

/// Refuses, before any work, a `path` that [`klein::fsutil::write_atomic`] could not write (its
/// directory takes no new file); `what` names it in the message (`--out-dir out`).
pub(crate) fn check_writable(what: &str, path: &Path) -> anyhow::Result<()> {
    klein::fsutil::check_writable(path).map_err(|e| {
        UsageError(format!(
            "{what}: {}; give a path in a directory you can write to",
            klein::error::chain(&e)
        ))
        .into()
    })
}

/// Output paths: `out.png`, or `out-1.png` ... `out-N.png` for a batch.
fn output_paths(output: &Path, n: usize) -> Vec<PathBuf> {
    if n == 1 {
        return vec![output.to_path_buf()];
    }
    let stem = output
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "klein".into());
    match output.extension() {
        Some(ext) => (1..=n)
            .map(|i| output.with_file_name(format!("{stem}-{i}.{}", ext.to_string_lossy())))
            .collect(),
        None => (1..=n)
            .map(|i| output.with_file_name(format!("{stem}-{i}")))
            .collect(),
    }
}
