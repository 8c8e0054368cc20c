//! Where the ONNX Runtime library is looked for, in order: the path given, `ORT_DYLIB_PATH`, the
//! path baked in at build time (`KLEIN_ORT_DYLIB`), next to the executable, the repository's
//! `.ort/` (`scripts/setup-ort.sh`), klein's cache (`klein setup`), the `onnxruntime` Python
//! package of the active environment (`$VIRTUAL_ENV`, `$CONDA_PREFIX`) or of `python3`, and the
//! system's library folders. A `cargo install`ed `klein` thus runs where users already have the
//! library, or after one `klein setup`.
use std::ffi::OsString;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{KleinError, Result};
use crate::fsutil::cache_dir_from;

/// Environment variable naming the ONNX Runtime library (the name `ort` itself uses).
pub const ORT_DYLIB_ENV: &str = "ORT_DYLIB_PATH";

/// What to tell a user who has no usable library.
pub(super) const HOW_TO_PROVIDE: &str = "Provide ONNX Runtime 1.31 or newer: run `klein setup` (it installs the \
     official library into klein's cache), or `pip install onnxruntime==1.31.1` (klein finds the package's \
     library), or set ORT_DYLIB_PATH to its shared library; in a clone of klein, scripts/setup-ort.sh \
     installs it into .ort/";

/// How the ONNX Runtime library was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LibrarySource {
    /// [`super::RuntimeOptions::with_library`].
    Explicit,
    /// The `ORT_DYLIB_PATH` environment variable.
    EnvVar,
    /// `KLEIN_ORT_DYLIB` at build time.
    BuildTime,
    /// Next to the executable.
    NextToExecutable,
    /// `<executable dir>/../../.ort/`, filled by `scripts/setup-ort.sh`.
    RepoOrtDir,
    /// `<cache dir>/ort/`, filled by `klein setup`.
    Setup,
    /// The `onnxruntime` Python package of the active environment, or of `python3`.
    PythonPackage,
    /// A folder of the system's library path.
    System,
}

impl fmt::Display for LibrarySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LibrarySource::Explicit => "given explicitly",
            LibrarySource::EnvVar => "from ORT_DYLIB_PATH",
            LibrarySource::BuildTime => "baked in at build time from KLEIN_ORT_DYLIB",
            LibrarySource::NextToExecutable => "found next to the executable",
            LibrarySource::RepoOrtDir => "found in the repository's .ort/ folder",
            LibrarySource::Setup => "installed by `klein setup` in klein's cache",
            LibrarySource::PythonPackage => "from the installed onnxruntime Python package",
            LibrarySource::System => "found in the system's library path",
        })
    }
}

/// Library path baked in at build time (`KLEIN_ORT_DYLIB=... cargo build`).
const BUILD_TIME_LIBRARY: Option<&str> = option_env!("KLEIN_ORT_DYLIB");

/// The folder of klein's cache that `klein setup` fills.
pub const SETUP_DIR: &str = "ort";

/// Finds the ONNX Runtime library without loading it (the search order is in the module docs).
pub fn locate_library(explicit: Option<&Path>) -> Result<(PathBuf, LibrarySource)> {
    if let Some(path) = explicit {
        return existing(path, LibrarySource::Explicit, "given explicitly");
    }
    if let Some(value) = std::env::var_os(ORT_DYLIB_ENV).filter(|v| !v.is_empty()) {
        return existing(
            Path::new(&value),
            LibrarySource::EnvVar,
            "the value of ORT_DYLIB_PATH",
        );
    }
    let mut looked = Vec::new();
    if let Some(baked) = BUILD_TIME_LIBRARY.filter(|s| !s.is_empty()) {
        let baked = Path::new(baked);
        if baked.is_file() {
            return Ok((baked.to_path_buf(), LibrarySource::BuildTime));
        }
        looked.push(format!(
            "{} (baked in at build time, now missing)",
            baked.display()
        ));
    }
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(Path::to_path_buf));
    let folders = candidate_folders(
        exe_dir.as_deref(),
        &|name| std::env::var_os(name),
        &python_package_folder,
    );
    for (dir, source) in folders {
        if let Some(found) = library_in_dir(&dir) {
            return Ok((found, source));
        }
        looked.push(dir.display().to_string());
    }
    Err(KleinError::RuntimeLibrary(format!(
        "no ONNX Runtime library found; ORT_DYLIB_PATH is not set and none was in: {}. {HOW_TO_PROVIDE}",
        looked.join(", ")
    )))
}

/// The folders searched after the explicit and baked-in paths, in order, each with how a library
/// found there is reported. `env` reads an environment variable; `python` gives the
/// `onnxruntime` package folder of `python3` (asked only when no environment's package is found).
fn candidate_folders(
    exe_dir: Option<&Path>,
    env: &dyn Fn(&str) -> Option<OsString>,
    python: &dyn Fn() -> Option<PathBuf>,
) -> Vec<(PathBuf, LibrarySource)> {
    let mut folders = Vec::new();
    if let Some(exe_dir) = exe_dir {
        folders.push((exe_dir.to_path_buf(), LibrarySource::NextToExecutable));
        if let Some(repo) = exe_dir.ancestors().nth(2) {
            folders.push((repo.join(".ort"), LibrarySource::RepoOrtDir));
        }
    }
    let var = |name: &str| env(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(cache) = cache_dir_from(env) {
        folders.push((cache.join(SETUP_DIR), LibrarySource::Setup));
    }
    let environments: Vec<PathBuf> = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(|name| var(name))
        .flat_map(|prefix| site_packages(&prefix))
        .map(|site| site.join("onnxruntime").join("capi"))
        .filter(|capi| capi.is_dir())
        .collect();
    let packages = if environments.is_empty() {
        python().map(|p| p.join("capi")).into_iter().collect()
    } else {
        environments
    };
    folders.extend(
        packages
            .into_iter()
            .map(|p| (p, LibrarySource::PythonPackage)),
    );
    let library_path = if cfg!(target_os = "macos") {
        "DYLD_LIBRARY_PATH"
    } else {
        "LD_LIBRARY_PATH"
    };
    if let Some(paths) = env(library_path) {
        folders.extend(std::env::split_paths(&paths).map(|p| (p, LibrarySource::System)));
    }
    let system: &[&str] = if cfg!(target_os = "macos") {
        &["/opt/homebrew/lib", "/usr/local/lib"]
    } else {
        &[
            "/usr/local/lib",
            "/usr/lib",
            "/usr/lib64",
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
        ]
    };
    folders.extend(
        system
            .iter()
            .map(|d| (PathBuf::from(d), LibrarySource::System)),
    );
    folders
}

/// The `site-packages` folders of a Python environment (`lib/python3.*/site-packages` on Unix,
/// `Lib/site-packages` on Windows).
fn site_packages(prefix: &Path) -> Vec<PathBuf> {
    let windows = prefix.join("Lib").join("site-packages");
    let mut found: Vec<PathBuf> = std::fs::read_dir(prefix.join("lib"))
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.ok())
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("python3"))
        .map(|entry| entry.path().join("site-packages"))
        .filter(|site| site.is_dir())
        .collect();
    found.sort();
    if windows.is_dir() {
        found.push(windows);
    }
    found
}

/// The folder of `python3`'s `onnxruntime` package, found without importing it (fast, and
/// nothing of it runs); `None` without `python3` or the package.
fn python_package_folder() -> Option<PathBuf> {
    let script = "import importlib.util as u; s = u.find_spec('onnxruntime'); \
                  print(s.submodule_search_locations[0] if s and s.submodule_search_locations else '')";
    let output = Command::new("python3").args(["-c", script]).output().ok()?;
    let text = String::from_utf8(output.stdout).ok()?;
    let folder = text.trim();
    (output.status.success() && !folder.is_empty()).then(|| PathBuf::from(folder))
}

fn existing(path: &Path, source: LibrarySource, what: &str) -> Result<(PathBuf, LibrarySource)> {
    if path.is_file() {
        Ok((path.to_path_buf(), source))
    } else {
        Err(KleinError::RuntimeLibrary(format!(
            "{} ({what}) does not exist. {HOW_TO_PROVIDE}",
            path.display()
        )))
    }
}

/// The ONNX Runtime main library in `dir` (not its provider plug-ins): the unversioned name if
/// present, else the highest versioned one (`libonnxruntime.so.1.31.1`, as the wheel ships it).
pub fn library_in_dir(dir: &Path) -> Option<PathBuf> {
    let (unversioned, prefix, suffix) = if cfg!(target_os = "windows") {
        ("onnxruntime.dll", "onnxruntime.dll", "")
    } else if cfg!(target_os = "macos") {
        ("libonnxruntime.dylib", "libonnxruntime.", ".dylib")
    } else {
        ("libonnxruntime.so", "libonnxruntime.so.", "")
    };
    let names: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|entry| entry.ok())
        .filter(|entry| entry.path().is_file())
        .filter_map(|entry| entry.file_name().into_string().ok())
        .filter(|name| name == unversioned || (name.starts_with(prefix) && name.ends_with(suffix)))
        .collect();
    if names.iter().any(|name| name == unversioned) {
        return Some(dir.join(unversioned));
    }
    names.into_iter().max().map(|name| dir.join(name))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    /// The order of the folders a `cargo install`ed klein searches: next to it, klein's cache
    /// (`klein setup`), the active environment's onnxruntime package (then `python3`'s is not
    /// asked), the library path, the system's folders.
    #[test]
    fn installed_binaries_search_the_cache_python_and_the_system() {
        let root = std::env::temp_dir().join(format!("klein-locate-{}", std::process::id()));
        let venv = root.join("venv");
        let capi = venv.join("lib/python3.11/site-packages/onnxruntime/capi");
        std::fs::create_dir_all(&capi).unwrap();
        let env_of = |vars: Vec<(&'static str, PathBuf)>| {
            move |name: &str| {
                vars.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        let asked = std::cell::Cell::new(false);
        let python = || {
            asked.set(true);
            Some(root.join("python3-site/onnxruntime"))
        };
        let env = env_of(vec![
            ("HOME", root.join("home")),
            ("VIRTUAL_ENV", venv.clone()),
            ("LD_LIBRARY_PATH", root.join("ld")),
        ]);
        let bin = root.join("home/.cargo/bin");
        let folders = candidate_folders(Some(&bin), &env, &python);
        let sources: Vec<_> = folders.iter().map(|(_, s)| *s).collect();
        assert_eq!(
            &sources[..4],
            [
                LibrarySource::NextToExecutable,
                LibrarySource::RepoOrtDir,
                LibrarySource::Setup,
                LibrarySource::PythonPackage,
            ]
        );
        assert_eq!(folders[2].0, root.join("home/.cache/klein/ort"));
        assert_eq!(folders[3].0, capi);
        assert!(
            !asked.get(),
            "python3 is not asked when an environment has the package"
        );
        if !cfg!(target_os = "macos") {
            assert_eq!(folders[4], (root.join("ld"), LibrarySource::System));
            assert!(folders.contains(&(PathBuf::from("/usr/lib"), LibrarySource::System)));
        }
        // No environment: python3's package; KLEIN_CACHE_DIR names the cache.
        let env = env_of(vec![("KLEIN_CACHE_DIR", root.join("cache"))]);
        let folders = candidate_folders(None, &env, &python);
        assert_eq!(folders[0], (root.join("cache/ort"), LibrarySource::Setup));
        assert_eq!(
            folders[1],
            (
                root.join("python3-site/onnxruntime/capi"),
                LibrarySource::PythonPackage
            )
        );
        assert!(asked.get());
        // The highest versioned library of a folder, not its provider plug-ins.
        if cfg!(target_os = "linux") {
            for name in [
                "libonnxruntime.so.1.30.0",
                "libonnxruntime.so.1.31.1",
                "libonnxruntime_providers_shared.so",
            ] {
                std::fs::write(capi.join(name), b"").unwrap();
            }
            assert_eq!(
                library_in_dir(&capi),
                Some(capi.join("libonnxruntime.so.1.31.1"))
            );
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}
