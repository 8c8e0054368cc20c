//! The LoRAs a server offers: the files of `--lora-dir` by name, resolved for each request (never
//! a client's path).
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use klein::pipeline::lora::inspect;
use klein::pipeline::{LoraSpec, Pipeline};

use super::error::ApiError;

/// The LoRAs a server offers: the `.safetensors` files of `--lora-dir`, by file stem, listed
/// when the server starts. A client names one (`"style"` or `"style:0.8"`); a name that is not
/// in the list is refused, whatever it contains, so no client-made path is ever opened.
#[derive(Debug, Default)]
pub(crate) struct LoraCatalog {
    files: BTreeMap<String, PathBuf>,
}

impl LoraCatalog {
    pub(crate) fn scan(dir: Option<&Path>) -> anyhow::Result<LoraCatalog> {
        let Some(dir) = dir else {
            return Ok(LoraCatalog::default());
        };
        let entries = std::fs::read_dir(dir).map_err(|e| {
            crate::UsageError(format!(
                "--lora-dir {}: {e}; give a directory of .safetensors files",
                dir.display()
            ))
        })?;
        let mut files = BTreeMap::new();
        for entry in entries.flatten() {
            let path = entry.path();
            let is_lora = path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("safetensors"));
            if let (true, Some(stem)) = (is_lora && path.is_file(), path.file_stem()) {
                files.insert(stem.to_string_lossy().into_owned(), path);
            }
        }
        Ok(LoraCatalog { files })
    }

    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.files.keys().map(String::as_str)
    }

    /// `NAME` or `NAME:SCALE`.
    pub(crate) fn resolve(&self, text: &str) -> Result<LoraSpec, ApiError> {
        let (name, scale) = match text.rsplit_once(':') {
            Some((name, scale)) => {
                let scale: f32 = scale.parse().map_err(|_| {
                    ApiError::field(
                        "loras",
                        format!("LoRA `{text}`: the scale after `:` is not a number"),
                    )
                })?;
                (name, scale)
            }
            None => (text, 1.0),
        };
        let path = self.files.get(name).ok_or_else(|| {
            let offered: Vec<&str> = self.names().collect();
            ApiError::field(
                "loras",
                if offered.is_empty() {
                    format!("LoRA `{name}`: this server offers no LoRAs (it was started without --lora-dir)")
                } else {
                    format!("LoRA `{name}` is not offered; this server has: {}", offered.join(", "))
                },
            )
        })?;
        // Checked under its name: a message never shows the server's path.
        LoraSpec::new(name, scale)
            .check()
            .map_err(|e| ApiError::from_klein(&e, Some("loras")))?;
        Ok(LoraSpec::new(path, scale))
    }

    /// Reads every LoRA and checks it against `pipeline`'s bundle, as a request would apply it.
    /// A file that is broken or does not fit the model (a shared `models/loras` folder holds
    /// SDXL and FLUX.1 files too) is not offered: it is dropped, and the warning for it
    /// returned.
    pub(crate) fn keep_usable(&mut self, pipeline: &Pipeline) -> Vec<String> {
        let mut warnings = Vec::new();
        self.files.retain(|name, path| {
            let spec = LoraSpec::new(path.as_path(), 1.0);
            match inspect(&[spec], pipeline.manifest(), pipeline.bundle_dir()) {
                Ok(_) => true,
                Err(e) => {
                    warnings.push(format!(
                        "--lora-dir: LoRA `{name}` cannot be offered, skipped: {}",
                        klein::error::chain(&e)
                    ));
                    false
                }
            }
        });
        warnings
    }

    pub(crate) fn resolve_all(&self, names: &[String]) -> Result<Vec<LoraSpec>, ApiError> {
        let specs = names
            .iter()
            .map(|n| self.resolve(n))
            .collect::<Result<Vec<_>, _>>()?;
        klein::pipeline::lora::check_specs(&specs)
            .map_err(|e| ApiError::from_klein(&e, Some("loras")))?;
        Ok(specs)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    #[test]
    fn lora_names_never_become_paths() {
        let dir = std::env::temp_dir().join(format!("klein-serve-loras-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("style.safetensors"), b"x").unwrap();
        std::fs::write(dir.join("notes.txt"), b"x").unwrap();
        let catalog = LoraCatalog::scan(Some(&dir)).unwrap();
        assert_eq!(catalog.names().collect::<Vec<_>>(), ["style"]);
        let spec = catalog.resolve("style:0.5").unwrap();
        assert_eq!(
            (spec.path(), spec.scale()),
            (dir.join("style.safetensors").as_path(), 0.5)
        );
        for bad in [
            "../style",
            "/etc/passwd",
            "notes",
            "style.safetensors",
            "style:x",
            "style:500",
        ] {
            assert_eq!(
                catalog.resolve(bad).unwrap_err().param.as_deref(),
                Some("loras"),
                "{bad}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
