//! Installed models: bundles in klein's models folder, each named by its folder. `klein-export pull
//! ORG/NAME` writes them there; every front end takes the name where it takes a bundle directory
//! (`--model`, `model=`), since [`crate::pipeline::Pipeline::load`] resolves it ([`resolve`]), and
//! `klein models` lists them ([`list_in`]). With the `hub` feature, a Hub id of a repository that
//! holds a klein bundle is fetched and installed here on first use ([`locate`]).
//!
//! The folder is `$KLEIN_MODELS_DIR`, else `$XDG_DATA_HOME/klein/models`, else
//! `$HOME/.local/share/klein/models`, else `%LOCALAPPDATA%\klein\models`.
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use super::manifest::MANIFEST_FILE;

/// The models folder of the environment (`None` when none of its variables is set).
pub fn models_dir() -> Option<PathBuf> {
    models_dir_from(&|name| std::env::var_os(name))
}

/// [`models_dir`] of the variables `env` gives.
pub fn models_dir_from(env: &dyn Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let var = |name: &str| env(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("KLEIN_MODELS_DIR")
        .or_else(|| var("XDG_DATA_HOME").map(|d| d.join("klein").join("models")))
        .or_else(|| {
            var("HOME").map(|d| d.join(".local").join("share").join("klein").join("models"))
        })
        .or_else(|| var("LOCALAPPDATA").map(|d| d.join("klein").join("models")))
}

/// The name `klein-export pull` gives a Hub repository's bundle by default: the repository's
/// name in lower case (`black-forest-labs/FLUX.2-klein-4B` -> `flux.2-klein-4b`).
pub fn default_name(repo_id: &str) -> Option<String> {
    let (org, name) = repo_id.split_once('/')?;
    let valid = |part: &str| {
        !part.is_empty()
            && part != "."
            && part != ".."
            && part
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    };
    (valid(org) && valid(name)).then(|| name.to_ascii_lowercase())
}

/// `model` as a bundle directory: itself when it exists; else the installed model it names, by
/// its name or by the Hub id it was pulled from (its default name); else itself, for
/// [`crate::bundle::Manifest::load`] to report.
pub fn resolve(model: &Path) -> PathBuf {
    resolve_in(model, models_dir().as_deref())
}

/// [`resolve`], and with the `hub` feature, a Hub id (`ORG/NAME`) that is neither a path nor an
/// installed model is fetched from the Hugging Face Hub and installed first, when its repository
/// holds a klein bundle ([`super::hub::fetch`]; progress bars when stderr is a terminal).
pub fn locate(model: &Path) -> crate::error::Result<PathBuf> {
    let resolved = resolve(model);
    #[cfg(feature = "hub")]
    if !resolved.exists() {
        if let (Some(text), Some(dir)) = (model.to_str(), models_dir()) {
            if let Some(name) = default_name(text) {
                use std::io::IsTerminal;
                let progress = std::io::stderr().is_terminal();
                return super::hub::fetch(text, None, &dir.join(name), progress);
            }
        }
    }
    Ok(resolved)
}

/// [`resolve`] with the models folder `dir`.
pub fn resolve_in(model: &Path, dir: Option<&Path>) -> PathBuf {
    if model.exists() {
        return model.to_path_buf();
    }
    let (Some(dir), Some(text)) = (dir, model.to_str()) else {
        return model.to_path_buf();
    };
    let name = if is_name(text) {
        Some(text.to_string())
    } else {
        default_name(text)
    };
    match name.map(|name| dir.join(name)) {
        Some(installed) if installed.join(MANIFEST_FILE).is_file() => installed,
        _ => model.to_path_buf(),
    }
}

/// A folder name, not a path: no separator, not `.` or `..`, not empty.
fn is_name(text: &str) -> bool {
    !text.is_empty() && text != "." && text != ".." && !text.contains(['/', '\\'])
}

/// The installed models of `dir`, by name: its folders that hold a manifest.
pub fn list_in(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut models: Vec<_> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| entry.path().join(MANIFEST_FILE).is_file())
        .filter_map(|entry| Some((entry.file_name().into_string().ok()?, entry.path())))
        .collect();
    models.sort();
    models
}

/// What [`crate::bundle::Manifest::load`] adds when `model` is not a directory: the installed
/// models, and how to get one.
pub fn missing_hint(model: &Path) -> String {
    let dir = models_dir();
    let installed = dir.as_deref().map(list_in).unwrap_or_default();
    let names: Vec<&str> = installed.iter().map(|(name, _)| name.as_str()).collect();
    let pull = match model.to_str().and_then(default_name) {
        Some(_) => format!(
            "`klein-export pull {}` downloads and converts it",
            model.display()
        ),
        None => {
            "`klein-export pull ORG/NAME` installs a model from the Hugging Face Hub".to_string()
        }
    };
    let folder = dir.map_or_else(
        || "no models folder: set KLEIN_MODELS_DIR".to_string(),
        |d| d.display().to_string(),
    );
    if names.is_empty() {
        format!("does not exist, and no model is installed ({folder}); pass a bundle directory, or {pull}")
    } else {
        format!(
            "does not exist, and is not an installed model ({folder}: {}); pass a bundle directory \
             or one of those names, or {pull}",
            names.join(", ")
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    #[test]
    fn the_folder_follows_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        let dir = |pairs| models_dir_from(&env(pairs));
        assert_eq!(
            dir(&[("KLEIN_MODELS_DIR", "/m"), ("HOME", "/h")]),
            Some("/m".into())
        );
        assert_eq!(
            dir(&[("XDG_DATA_HOME", "/x"), ("HOME", "/h")]),
            Some("/x/klein/models".into())
        );
        assert_eq!(
            dir(&[("HOME", "/h")]),
            Some("/h/.local/share/klein/models".into())
        );
        assert_eq!(
            dir(&[("KLEIN_MODELS_DIR", ""), ("HOME", "/h")]),
            Some("/h/.local/share/klein/models".into())
        );
        assert_eq!(dir(&[]), None);
    }

    #[test]
    fn names_and_hub_ids_resolve_to_installed_bundles_only() {
        let root = std::env::temp_dir().join(format!("klein-installed-{}", std::process::id()));
        let models = root.join("models");
        std::fs::create_dir_all(models.join("flux.2-klein-4b")).unwrap();
        std::fs::write(models.join("flux.2-klein-4b").join(MANIFEST_FILE), "{}").unwrap();
        std::fs::create_dir_all(models.join("empty")).unwrap();
        let resolve = |m: &str| resolve_in(Path::new(m), Some(&models));
        assert_eq!(resolve("flux.2-klein-4b"), models.join("flux.2-klein-4b"));
        assert_eq!(
            resolve("black-forest-labs/FLUX.2-klein-4B"),
            models.join("flux.2-klein-4b")
        );
        // Not installed, not a bundle, or a path: as given, for the manifest's error.
        assert_eq!(resolve("empty"), PathBuf::from("empty"));
        assert_eq!(resolve("other/model"), PathBuf::from("other/model"));
        assert_eq!(
            resolve("../flux.2-klein-4b"),
            PathBuf::from("../flux.2-klein-4b")
        );
        assert_eq!(
            resolve_in(Path::new("flux.2-klein-4b"), None),
            PathBuf::from("flux.2-klein-4b")
        );
        // An existing directory is itself, even when a model has its name.
        assert_eq!(resolve(root.to_str().unwrap()), root);
        let names: Vec<_> = list_in(&models).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["flux.2-klein-4b"]);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn default_names_are_lower_case_repository_names() {
        assert_eq!(
            default_name("black-forest-labs/FLUX.2-klein-4B").as_deref(),
            Some("flux.2-klein-4b")
        );
        for bad in ["noslash", "a/b/c", "/x", "x/", "a/..", "a b/c"] {
            assert_eq!(default_name(bad), None, "{bad}");
        }
    }
}
