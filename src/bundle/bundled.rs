//! The bundled tiny model (feature `tiny-model`), inside the binary or library that is built with
//! it: `klein generate` and Python's `klein.Pipeline()` work with no model named, wherever they are
//! installed, not only in the repository they were built from. Its files are written once to the
//! cache directory, then used from there like any bundle (checked against their manifest at every
//! load, with the verification stamp). Random weights: for a first run and for tests, not images.
use std::path::PathBuf;

use super::default_cache_dir;
use crate::error::{KleinError, Result};
use crate::fsutil::{sha256_hex, write_atomic};

macro_rules! bundled {
    ($($name:literal),* $(,)?) => {
        &[$(($name, include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/onnx/klein-tiny/", $name)))),*]
    };
}

/// Every file of `onnx/klein-tiny/`, manifest last.
pub const FILES: &[(&str, &[u8])] = bundled!(
    "text_encoder.onnx",
    "tokenizer.json",
    "transformer.onnx",
    "vae_decoder.onnx",
    "vae_encoder.onnx",
    "manifest.json",
);

/// The directory of the bundled model: `<cache>/bundled/<manifest sha256>/`, each file written
/// there when it is missing or differs from the binary's (a copy damaged or half cleaned away by a
/// temporary-file cleaner is repaired, not reported as a bundle to export again). The cache is
/// [`default_cache_dir`], else the system's temporary directory.
pub fn tiny_model_dir() -> Result<PathBuf> {
    let (_, manifest) = FILES[FILES.len() - 1];
    let dir = default_cache_dir()
        .unwrap_or_else(|| std::env::temp_dir().join("klein"))
        .join("bundled")
        .join(&sha256_hex(manifest)[..16]);
    // 19 MB compared: milliseconds, against the load that follows.
    let stale: Vec<_> = FILES
        .iter()
        .filter(|(name, bytes)| std::fs::read(dir.join(name)).map_or(true, |b| b != *bytes))
        .collect();
    if !stale.is_empty() {
        std::fs::create_dir_all(&dir).map_err(|e| {
            KleinError::request_about("model", format!(
                "cannot create {} for the bundled model ({e}): the cache directory ($KLEIN_CACHE_DIR, \
                 else $XDG_CACHE_HOME/klein, else ~/.cache/klein) must be a directory klein can write; \
                 set KLEIN_CACHE_DIR to one, or name a bundle (-m in the CLI, model= in Python)",
                dir.display()
            ))
        })?;
        for (name, bytes) in stale {
            write_atomic(&dir.join(name), bytes)?;
        }
    }
    Ok(dir)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    /// The embedded files are exactly the bundle's: its manifest's `files` and the manifest.
    #[test]
    fn every_file_of_the_bundle_is_embedded() {
        let (_, manifest) = FILES[FILES.len() - 1];
        let manifest: serde_json::Value = serde_json::from_slice(manifest).unwrap();
        let mut listed: Vec<&str> = manifest["files"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        listed.push("manifest.json");
        let embedded: Vec<&str> = FILES.iter().map(|(name, _)| *name).collect();
        assert_eq!(embedded, listed);
    }
}
