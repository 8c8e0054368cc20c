//! The files the command line writes: output paths and format checked before any work, and the
//! settings stored in each image.
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::path::{Path, PathBuf};

use anyhow::Context;
use klein::bundle::manifest::ModelVariant;
use klein::bundle::MANIFEST_FILE;
use klein::pipeline::{Generation, Pipeline};
use klein::stages::output::ImageFormat;

use crate::UsageError;

/// The files `--output` names for `n` images (`out.png`, or `out-1.png` ... `out-N.png`) and
/// their format, refused before any work when they could not be written once the images are made:
/// a directory (or a path ending in a separator), a missing directory, an unknown extension.
pub(crate) fn output_files(
    output: &Path,
    n: usize,
    jpeg_quality: u8,
) -> anyhow::Result<(Vec<PathBuf>, ImageFormat)> {
    let text = output.as_os_str().to_string_lossy();
    if output.is_dir() || text.ends_with(std::path::is_separator) || output.file_name().is_none() {
        let what = if output.is_dir() {
            "is a directory"
        } else {
            "names a directory (it ends with a separator)"
        };
        return Err(UsageError(format!(
            "output {} {what}; give a file name such as {}",
            output.display(),
            output.join("klein.png").display()
        ))
        .into());
    }
    let format = ImageFormat::from_path(output, jpeg_quality)?;
    let paths = output_paths(output, n);
    for path in &paths {
        if path.is_dir() {
            return Err(UsageError(format!(
                "output {} is a directory; give another file name",
                path.display()
            ))
            .into());
        }
        let parent = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if !parent.is_dir() {
            return Err(UsageError(format!(
                "output {}: the directory {} does not exist; create it first",
                path.display(),
                parent.display()
            ))
            .into());
        }
    }
    Ok((paths, format))
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

/// A seed for a generation that names none (printed and stored, so the image can be remade).
pub(crate) fn random_seed() -> u64 {
    RandomState::new().hash_one(std::process::id())
}

/// sha256 of the bundle's manifest.json, stored in every PNG.
pub(crate) fn bundle_sha256(pipeline: &Pipeline) -> anyhow::Result<String> {
    let path = pipeline.bundle_dir().join(MANIFEST_FILE);
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(klein::fsutil::sha256_hex(&bytes))
}

/// The PNG's text metadata: everything needed to make the image again.
pub(crate) fn png_text(
    pipeline: &Pipeline,
    g: &Generation,
    prompt: &str,
    refs: &[PathBuf],
    device: &str,
    bundle_hash: &str,
) -> anyhow::Result<Vec<(String, String)>> {
    let manifest = pipeline.manifest();
    let refs: Vec<String> = refs.iter().map(|r| r.display().to_string()).collect();
    let loras: Vec<String> = pipeline
        .loras()
        .iter()
        .map(|l| format!("{}:{}", l.path.display(), l.scale))
        .collect();
    Ok(vec![
        ("prompt".into(), prompt.into()),
        ("seed".into(), g.seed.to_string()),
        ("steps".into(), g.steps.to_string()),
        ("guidance".into(), g.guidance.to_string()),
        ("size".into(), format!("{}x{}", g.width, g.height)),
        ("model".into(), manifest.model.name.clone()),
        (
            "model_variant".into(),
            variant_name(manifest.model.variant)?,
        ),
        ("bundle_sha256".into(), bundle_hash.to_string()),
        ("device".into(), device.into()),
        ("references".into(), serde_json::to_string(&refs)?),
        ("loras".into(), serde_json::to_string(&loras)?),
        (
            "Software".into(),
            format!("klein {}", env!("CARGO_PKG_VERSION")),
        ),
    ])
}

/// The manifest's name of a model variant (`4b`, `9b`, `tiny`, `custom`).
pub(crate) fn variant_name(variant: ModelVariant) -> anyhow::Result<String> {
    let value = serde_json::to_value(variant)?;
    value
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("model variant {value} is not a string"))
}
