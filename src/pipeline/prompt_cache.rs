//! Prompt embeddings on disk, so that the text encoder runs once per prompt across processes:
//! [`PromptCache`], keyed by the bundle's text encoder and tokenizer files (their sha256 in the
//! manifest), the tokenizer's template and padding, the device's settings that change outputs, and
//! the prompt; one safetensors file per prompt, the least recently used removed past a size limit.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use ndarray::Array3;
use safetensors::{tensor::TensorView, Dtype, SafeTensors};
use sha2::{Digest, Sha256};

use crate::bundle::Manifest;
use crate::error::{KleinError, Result};
use crate::fsutil::{hex, remove_least_recent, sha256_hex, touch, write_atomic};

const TENSOR: &str = "prompt_embeds";

/// Metadata key of an entry's bundle key (what [`PromptCache::new`] derives from the manifest).
const META_BUNDLE: &str = "klein.bundle";
/// Metadata key of the sha256 of the entry's prompt.
const META_PROMPT: &str = "klein.prompt_sha256";

/// The default limit of a prompt cache directory's entries, in MiB: 4 GiB, about 270 prompts of
/// the 4B (15.7 MB each: `[1, 512, 7680]` float32).
pub const DEFAULT_PROMPT_CACHE_MIB: u64 = 4096;

/// Extension of a prompt cache entry's file name (after its 64 hex digits).
const ENTRY_EXTENSION: &str = ".safetensors";

/// The on-disk cache of prompt embeddings. Entries are checked when read (their bundle, device
/// settings and prompt, dtype, shape, finite values): a bad one is a miss, reported as such, and rewritten. Past the
/// size limit, the least recently used entries of the directory are removed when one is written
/// (the one written stays, even alone over the limit).
#[derive(Debug, Clone)]
pub struct PromptCache {
    dir: PathBuf,
    /// What the embeddings depend on in the bundle (the device comes with each lookup).
    bundle_key: String,
    /// `[1, max_sequence_length, embed_dim]` of this bundle (FLUX.3: the length is any window of
    /// `tokenizer`).
    shape: [usize; 3],
    tokenizer: crate::stages::tokenize::TokenizerSpec,
    /// Most bytes the directory's entries (of every bundle) may take.
    max_bytes: u64,
}

/// What a cache lookup found.
#[derive(Debug, Clone, PartialEq)]
pub enum CacheLookup {
    /// A valid entry, `[1, L, D]`.
    Hit(Array3<f32>),
    /// No entry.
    Miss,
    /// An entry that cannot be used (why, naming the file); treat as a miss.
    Rejected(String),
}

impl PromptCache {
    /// A cache in `dir` for the bundle described by `manifest`, whose entries take at most
    /// `max_mib` MiB together. Each lookup and write names the settings its text encoder runs
    /// with (`numerics`: [`crate::runtime::SessionConfig`]'s that change outputs, the device's).
    pub fn new(dir: PathBuf, manifest: &Manifest, max_mib: u64) -> PromptCache {
        let encoder = &manifest.graphs.text_encoder.file;
        let tokenizer = manifest
            .files
            .get(&manifest.tokenizer.file)
            .map(|f| f.sha256.as_str())
            .unwrap_or_default();
        // Everything the embeddings depend on: the encoder graph and its weights' files, the
        // tokenizer's file, how a prompt becomes tokens (template, padding, length); the device
        // with each entry.
        let material = format!(
            "{}\n{tokenizer}\n{}\n{}",
            super::graphs::cache_tag(manifest, Path::new(encoder)).unwrap_or_default(),
            serde_json::to_string(&manifest.tokenizer).unwrap_or_default(),
            serde_json::to_string(&manifest.text_encoder).unwrap_or_default(),
        );
        let shape = [
            1,
            manifest.tokenizer.max_sequence_length,
            manifest.text_encoder.embed_dim,
        ];
        PromptCache {
            dir,
            bundle_key: sha256_hex(material.as_bytes()),
            shape,
            tokenizer: manifest.tokenizer.clone(),
            max_bytes: max_mib.saturating_mul(1024 * 1024),
        }
    }

    /// The key of the entries of this bundle's encoder run with `numerics`.
    fn key(&self, numerics: &str) -> String {
        sha256_hex(format!("{}\n{numerics}", self.bundle_key).as_bytes())
    }

    fn path(&self, key: &str, prompt: &str) -> PathBuf {
        let mut hasher = Sha256::new();
        hasher.update(key.as_bytes());
        hasher.update([0]);
        hasher.update(prompt.as_bytes());
        self.dir
            .join(format!("{}{ENTRY_EXTENSION}", hex(&hasher.finalize())))
    }

    /// The cached embeddings of `prompt` encoded with `numerics`, checked: written for this
    /// bundle, device settings and prompt, float32 of shape `[1, L, D]`, every value finite.
    pub fn get(&self, prompt: &str, numerics: &str) -> CacheLookup {
        let key = self.key(numerics);
        let path = self.path(&key, prompt);
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            // Missing, or its directory is (a file in the way): no entry. A cache that cannot be
            // written is reported by `put`.
            Err(_) if !path.exists() => return CacheLookup::Miss,
            Err(e) => return self.rejected(&path, &format!("unreadable ({e})")),
        };
        match self.check_entry(&bytes, &key, prompt) {
            Ok(embeds) => {
                // Used now: the last to be removed. A cache this process cannot write (shared
                // read-only) is still read.
                let _ = touch(&path);
                CacheLookup::Hit(embeds)
            }
            Err(reason) => self.rejected(&path, &reason),
        }
    }

    fn rejected(&self, path: &Path, reason: &str) -> CacheLookup {
        CacheLookup::Rejected(format!(
            "prompt cache entry {} {reason}; encoding the prompt again",
            path.display()
        ))
    }

    /// The embeddings of a valid entry, or why it is not one.
    fn check_entry(
        &self,
        bytes: &[u8],
        key: &str,
        prompt: &str,
    ) -> std::result::Result<Array3<f32>, String> {
        let (_, metadata) = SafeTensors::read_metadata(bytes)
            .map_err(|e| format!("is not a safetensors file ({e})"))?;
        let meta = metadata.metadata().clone().unwrap_or_default();
        if meta.get(META_BUNDLE).map(String::as_str) != Some(key)
            || meta.get(META_PROMPT) != Some(&sha256_hex(prompt.as_bytes()))
        {
            return Err("was written for another bundle, device setting or prompt".to_string());
        }
        let tensors = SafeTensors::deserialize(bytes)
            .map_err(|e| format!("is not a safetensors file ({e})"))?;
        let view = tensors
            .tensor(TENSOR)
            .map_err(|_| format!("has no `{TENSOR}` tensor"))?;
        let [_, _, width] = self.shape;
        let fits = matches!(view.shape(), &[1, l, d] if self.tokenizer.is_window(l) && d == width);
        if view.dtype() != Dtype::F32 || !fits {
            return Err(format!(
                "holds {:?} {:?}, this bundle's embeddings are F32 {:?}",
                view.dtype(),
                view.shape(),
                self.shape
            ));
        }
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if values.iter().any(|v| !v.is_finite()) {
            return Err("holds non-finite values".to_string());
        }
        Array3::from_shape_vec((1, view.shape()[1], width), values).map_err(|e| e.to_string())
    }

    /// Stores `embeds` for `prompt` encoded with `numerics` (atomically: a reader never sees a
    /// partial entry), then removes the least recently used entries past the limit.
    pub fn put(&self, prompt: &str, numerics: &str, embeds: &Array3<f32>) -> Result<()> {
        std::fs::create_dir_all(&self.dir).map_err(|source| KleinError::Io {
            path: self.dir.clone(),
            action: "create the prompt cache directory",
            source,
        })?;
        let data: Vec<u8> = embeds.iter().flat_map(|v| v.to_le_bytes()).collect();
        let (b, l, d) = embeds.dim();
        let view = TensorView::new(Dtype::F32, vec![b, l, d], &data).map_err(|e| {
            KleinError::Inference {
                stage: "prompt cache",
                message: e.to_string(),
            }
        })?;
        let key = self.key(numerics);
        let metadata = HashMap::from([
            (META_BUNDLE.to_string(), key.clone()),
            (META_PROMPT.to_string(), sha256_hex(prompt.as_bytes())),
        ]);
        let bytes = safetensors::serialize([(TENSOR, view)], Some(metadata)).map_err(|e| {
            KleinError::Inference {
                stage: "prompt cache",
                message: e.to_string(),
            }
        })?;
        let path = self.path(&key, prompt);
        write_atomic(&path, &bytes)?;
        self.evict(&path)
    }

    /// Removes the least recently used entries (the oldest modification time, which a hit renews)
    /// until the directory's entries take at most the limit; `keep`, the entry just written, stays.
    /// Only klein's entries are counted and removed (named `<64 hex digits>.safetensors`, with
    /// this cache's metadata in their header): whatever else the directory holds is left alone.
    /// Entries another process removes meanwhile are skipped; one that cannot be removed (another
    /// user's) is passed over, the next ones removed, and the first such error returned.
    fn evict(&self, keep: &Path) -> Result<()> {
        let listing = std::fs::read_dir(&self.dir).map_err(|source| KleinError::Io {
            path: self.dir.clone(),
            action: "list the prompt cache directory",
            source,
        })?;
        let mut total = 0u64;
        let mut old = Vec::new(); // (modified, path, bytes)
        for item in listing.flatten() {
            let path = item.path();
            let Ok(meta) = item.metadata() else { continue };
            if !meta.is_file() || !is_entry(&path) {
                continue;
            }
            total += meta.len();
            if path != keep {
                old.push((meta.modified().unwrap_or(UNIX_EPOCH), path, meta.len()));
            }
        }
        match remove_least_recent(old, total, self.max_bytes, |path| {
            std::fs::remove_file(path)
        }) {
            (_, Some((path, source))) => Err(KleinError::Io {
                path,
                action: "remove an old prompt cache entry",
                source,
            }),
            (_, None) => Ok(()),
        }
    }
}

/// Whether `path` is one of klein's entries: named `<64 hex digits>.safetensors`, and a
/// safetensors header with [`META_BUNDLE`] in its metadata (a sha256-named file of someone
/// else's, a LoRA say, is not one).
fn is_entry(path: &Path) -> bool {
    use std::io::Read;
    let named = path
        .file_name()
        .and_then(|name| name.to_str())
        .and_then(|name| name.strip_suffix(ENTRY_EXTENSION))
        .is_some_and(|hash| hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()));
    let header = || -> Option<serde_json::Value> {
        let mut file = std::fs::File::open(path).ok()?;
        let mut length = [0u8; 8];
        file.read_exact(&mut length).ok()?;
        // An entry's header is a few hundred bytes; a larger one is not klein's.
        let length = usize::try_from(u64::from_le_bytes(length))
            .ok()
            .filter(|&n| n <= 64 * 1024)?;
        let mut header = vec![0u8; length];
        file.read_exact(&mut header).ok()?;
        serde_json::from_slice(&header).ok()
    };
    named && header().is_some_and(|header| header["__metadata__"][META_BUNDLE].is_string())
}
