//! Bundles on the Hugging Face Hub: `--model ORG/NAME` (every front end) for a repository that
//! holds a klein bundle (a `manifest.json`, no `model_index.json`). Its files come through `hf-hub`
//! into the Hugging Face cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`, the cache diffusers and `huggingface_hub` share), from `$HF_ENDPOINT`
//! when set, with `$HF_TOKEN` or the token `hf auth login` saved; `HF_HUB_OFFLINE=1` reads the
//! cache only. Each file the manifest lists is checked against the manifest's size and sha256
//! before anything is installed; the bundle is then installed into the models folder under the
//! repository's default name (`super::installed::locate` decides where), as `klein-export pull`
//! installs it, so that the next run needs no network. A repository that holds a diffusers checkpoint is
//! refused with the command that converts it (`klein-export pull`).
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};

use super::manifest::{FileEntry, MANIFEST_FILE};
use crate::error::{KleinError, Result};
use crate::fsutil::sha256_file;

/// The diffusers indexes that mark a checkpoint repository (FLUX.2, FLUX.3's modular pipeline).
const CHECKPOINT_INDEXES: [&str; 2] = ["model_index.json", "modular_model_index.json"];

/// Where the files come from: `HF_HUB_OFFLINE` (as `huggingface_hub` reads it) means the cache only.
fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .is_ok_and(|v| ["1", "on", "yes", "true"].contains(&v.trim().to_ascii_lowercase().as_str()))
}

/// The Hugging Face cache folder, as `huggingface_hub` finds it.
fn cache() -> Cache {
    match std::env::var_os("HF_HUB_CACHE").filter(|v| !v.is_empty()) {
        Some(dir) => Cache::new(PathBuf::from(dir)),
        None => Cache::from_env(),
    }
}

fn hub_error(repo: &str, reason: impl Into<String>) -> KleinError {
    KleinError::Hub {
        repo: repo.to_string(),
        reason: reason.into(),
    }
}

/// What the Hub's answer `error` means, as an instruction to the user. `file`: the file asked for.
fn explain(repo: &str, file: Option<&str>, error: ApiError) -> KleinError {
    let page = format!("https://huggingface.co/{repo}");
    let status = match &error {
        ApiError::RequestError(inner) => match inner.as_ref() {
            ureq::Error::Status(code, response) => {
                Some((*code, response.header("x-error-code").map(str::to_string)))
            }
            ureq::Error::Transport(_) => None,
        },
        _ => None,
    };
    let reason = match status {
        Some((_, Some(code))) if code == "GatedRepo" => format!(
            "a gated repository: accept its terms on {page} with your account, then log in \
             (`hf auth login`) or set HF_TOKEN to a token of that account"
        ),
        Some((_, Some(code))) if code == "RevisionNotFound" => {
            format!("no such revision (give a branch, tag or commit of {page})")
        }
        Some((_, Some(code))) if code == "EntryNotFound" => match file {
            Some(file) => format!("the repository has no {file}"),
            None => "a file is missing from the repository".to_string(),
        },
        Some((401 | 404, _)) => format!(
            "{}no such model repository on the Hub (or a private one: check the id, or log in \
             with `hf auth login` or set HF_TOKEN)",
            not_here(file)
        ),
        Some((403, _)) => format!(
            "the Hub refused access (HTTP 403): accept the terms on {page}, or check HF_TOKEN"
        ),
        Some((code, _)) => format!("the Hub answered HTTP {code} ({error})"),
        None => format!(
            "{}the Hub cannot be reached ({error}); set HF_HUB_OFFLINE=1 to use the Hugging Face \
             cache only, or pass a bundle directory",
            not_here(file)
        ),
    };
    hub_error(repo, reason)
}

/// Where the repository itself was asked for (`file` None), the id was also a path that does not
/// exist: a mistyped bundle directory reads as a Hub id, and the message says both.
fn not_here(file: Option<&str>) -> &'static str {
    match file {
        None => "no such directory here, and ",
        Some(_) => "",
    }
}

/// The `files` of a bundle's manifest: all `fetch` needs before the bundle is whole.
#[derive(serde::Deserialize)]
struct ManifestFiles {
    files: BTreeMap<String, FileEntry>,
}

/// One file of the repository. Online: from the cache's snapshot of the commit the Hub names now,
/// else downloaded into it (a repository updated since the last fetch gives its new files).
/// Offline: from the cache's snapshot of the revision.
struct Source {
    repo_id: String,
    cache: hf_hub::CacheRepo,
    /// The Hub client and the cache's snapshot folder of the Hub's current commit (online only).
    api: Option<(ApiRepo, PathBuf)>,
}

impl Source {
    fn get(&self, file: &str) -> Result<PathBuf> {
        match &self.api {
            Some((_, snapshot)) if snapshot.join(file).is_file() => Ok(snapshot.join(file)),
            Some((api, _)) => api
                .download(file)
                .map_err(|e| explain(&self.repo_id, Some(file), e)),
            None => self.cache.get(file).ok_or_else(|| {
                // The manifest is asked for first: without it, the id may be a mistyped path.
                let here = not_here((file != MANIFEST_FILE).then_some(file));
                hub_error(
                    &self.repo_id,
                    format!(
                        "{here}{file} is not in the Hugging Face cache, and HF_HUB_OFFLINE is set: \
                         download it where the Hub is reachable, or pass a bundle directory"
                    ),
                )
            }),
        }
    }
}

/// Downloads the bundle of Hub repository `repo_id` (at `revision`, else `main`), checks every
/// file against its manifest, and installs it as the folder `dest` (in the models folder, named as
/// [`super::installed::default_name`] names it); its path. `progress`: `hf-hub`'s progress bars on
/// stderr, one per file downloaded.
pub fn fetch(
    repo_id: &str,
    revision: Option<&str>,
    dest: &Path,
    progress: bool,
) -> Result<PathBuf> {
    let revision = revision.unwrap_or("main").to_string();
    let repo = Repo::with_revision(repo_id.to_string(), RepoType::Model, revision);
    let cache = cache();
    let api = if offline() {
        None
    } else {
        let token = std::env::var("HF_TOKEN")
            .ok()
            .filter(|t| !t.is_empty())
            .or_else(|| cache.token());
        let api = ApiBuilder::from_cache(cache.clone())
            .with_endpoint(
                std::env::var("HF_ENDPOINT")
                    .unwrap_or_else(|_| "https://huggingface.co".to_string()),
            )
            .with_token(token)
            .with_progress(progress)
            .with_retries(2)
            .build()
            .map_err(|e| hub_error(repo_id, format!("cannot start a Hub client ({e})")))?;
        let api = api.repo(repo.clone());
        // What the repository holds: a bundle, or a checkpoint that needs converting.
        let info = api.info().map_err(|e| explain(repo_id, None, e))?;
        let holds = |file: &str| info.siblings.iter().any(|s| s.rfilename == file);
        if CHECKPOINT_INDEXES.iter().any(|index| holds(index)) {
            return Err(hub_error(
                repo_id,
                format!(
                    "holds a diffusers checkpoint, not a klein bundle: `klein-export pull \
                     {repo_id}` downloads and converts it (add `--quantize int8` for an int8 \
                     bundle)"
                ),
            ));
        }
        if !holds(MANIFEST_FILE) {
            return Err(hub_error(
                repo_id,
                format!("holds no {MANIFEST_FILE}: it is not a klein bundle (nor a diffusers checkpoint)"),
            ));
        }
        let snapshot = cache
            .path()
            .join(repo.folder_name())
            .join("snapshots")
            .join(&info.sha);
        Some((api, snapshot))
    };
    let source = Source {
        repo_id: repo_id.to_string(),
        cache: cache.repo(repo),
        api,
    };
    let manifest_path = source.get(MANIFEST_FILE)?;
    let text = std::fs::read_to_string(&manifest_path).map_err(|source| KleinError::Io {
        path: manifest_path.clone(),
        action: "reading",
        source,
    })?;
    let manifest: ManifestFiles = serde_json::from_str(&text).map_err(|e| {
        hub_error(
            repo_id,
            format!("its {MANIFEST_FILE} is not a klein manifest with `files` ({e})"),
        )
    })?;
    if let Some(bad) = manifest.files.keys().find(|f| !is_plain_name(f)) {
        return Err(hub_error(
            repo_id,
            format!("its manifest lists `{bad}`, a file outside the bundle's folder"),
        ));
    }
    let mut files = vec![(MANIFEST_FILE.to_string(), manifest_path)];
    for (file, want) in &manifest.files {
        let path = source.get(file)?;
        let bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        let sha256 = sha256_file(&path)?;
        if bytes != want.bytes || sha256 != want.sha256 {
            return Err(hub_error(
                repo_id,
                format!(
                    "{file} does not match the manifest (sha256 {sha256}, {bytes} bytes; the \
                     manifest says {}, {} bytes): the download is damaged or the repository is \
                     inconsistent; nothing was installed",
                    want.sha256, want.bytes
                ),
            ));
        }
        files.push((file.clone(), path));
    }
    install(&files, dest)
}

/// A file name with no folder: what a bundle's manifest may list.
fn is_plain_name(file: &str) -> bool {
    !file.is_empty() && file != "." && file != ".." && !file.contains(['/', '\\'])
}

/// Installs `files` (name, path in the cache) as the folder `dest`, whole or not at all: into a
/// temporary sibling first, then renamed. Each file is a hard link to the cache's blob where the
/// file system allows (no second copy on disk; the link outlives the cache), else a copy.
fn install(files: &[(String, PathBuf)], dest: &Path) -> Result<PathBuf> {
    let io = |path: &Path, action: &'static str| {
        let path = path.to_path_buf();
        move |source| KleinError::Io {
            path,
            action,
            source,
        }
    };
    let parent = dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io(parent, "creating the models folder"))?;
    let staging = parent.join(format!(
        ".{}.partial-{}",
        dest.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("bundle"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir(&staging).map_err(io(&staging, "creating"))?;
    let result = (|| {
        for (name, path) in files {
            // The cache's snapshot entries are links to its blobs.
            let blob = std::fs::canonicalize(path).map_err(io(path, "reading"))?;
            let target = staging.join(name);
            if std::fs::hard_link(&blob, &target).is_err() {
                std::fs::copy(&blob, &target).map_err(io(&target, "copying into"))?;
            }
        }
        std::fs::rename(&staging, dest).map_err(io(dest, "installing the bundle as"))
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    result.map(|()| dest.to_path_buf())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    #[test]
    fn manifests_may_list_plain_names_only() {
        assert!(is_plain_name("transformer.onnx"));
        for bad in ["", ".", "..", "../x", "a/b", "a\\b", "/etc/passwd"] {
            assert!(!is_plain_name(bad), "{bad}");
        }
    }

    #[test]
    fn installs_whole_folders_and_leaves_nothing_on_failure() {
        let root = std::env::temp_dir().join(format!("klein-hub-install-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("cache")).unwrap();
        let a = root.join("cache").join("a");
        std::fs::write(&a, b"alpha").unwrap();
        let models = root.join("models");
        let files = vec![("a.onnx".to_string(), a.clone())];
        let dest = install(&files, &models.join("m")).unwrap();
        assert_eq!(std::fs::read(dest.join("a.onnx")).unwrap(), b"alpha");
        // A missing file: no folder, no leftover staging folder.
        let missing = vec![
            ("a.onnx".to_string(), a),
            ("b.onnx".to_string(), root.join("cache").join("absent")),
        ];
        assert!(install(&missing, &models.join("n")).is_err());
        let left: Vec<_> = std::fs::read_dir(&models).unwrap().flatten().collect();
        assert_eq!(left.len(), 1, "{left:?}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
