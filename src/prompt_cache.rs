//! Optional on-disk cache of prompt embeddings, keyed by the bundle's text encoder and tokenizer
//! (their sha256 in the manifest) and the prompt. One safetensors file per prompt.
use std::path::PathBuf;

use ndarray::Array3;
use safetensors::{tensor::TensorView, Dtype, SafeTensors};
use sha2::{Digest, Sha256};

use crate::error::{KleinError, Result};
use crate::manifest::Manifest;
use crate::output::write_atomic;

const TENSOR: &str = "prompt_embeds";

#[derive(Debug, Clone)]
pub struct PromptCache {
    dir: PathBuf,
    bundle_key: String,
}

impl PromptCache {
    /// A cache in `dir` for the bundle described by `manifest`.
    pub fn new(dir: PathBuf, manifest: &Manifest) -> PromptCache {
        let file_hash = |name: &str| {
            manifest
                .files
                .get(name)
                .map(|f| f.sha256.clone())
                .unwrap_or_default()
        };
        let bundle_key = format!(
            "{}:{}:{}",
            file_hash(&manifest.graphs.text_encoder.file),
            file_hash(&manifest.tokenizer.file),
            manifest.tokenizer.max_sequence_length
        );
        PromptCache { dir, bundle_key }
    }

    fn path(&self, prompt: &str) -> PathBuf {
        let mut hasher = Sha256::new();
        hasher.update(self.bundle_key.as_bytes());
        hasher.update([0]);
        hasher.update(prompt.as_bytes());
        let digest: String = hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        self.dir.join(format!("{digest}.safetensors"))
    }

    /// The cached embeddings `[1, L, D]`, or `None` (a missing or unreadable entry is a miss).
    pub fn get(&self, prompt: &str) -> Option<Array3<f32>> {
        let bytes = std::fs::read(self.path(prompt)).ok()?;
        let tensors = SafeTensors::deserialize(&bytes).ok()?;
        let view = tensors.tensor(TENSOR).ok()?;
        let shape = view.shape();
        if view.dtype() != Dtype::F32 || shape.len() != 3 {
            return None;
        }
        let values: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Array3::from_shape_vec((shape[0], shape[1], shape[2]), values).ok()
    }

    /// Stores `embeds` for `prompt` (atomically: a reader never sees a partial entry).
    pub fn put(&self, prompt: &str, embeds: &Array3<f32>) -> Result<()> {
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
        let bytes =
            safetensors::serialize([(TENSOR, view)], None).map_err(|e| KleinError::Inference {
                stage: "prompt cache",
                message: e.to_string(),
            })?;
        write_atomic(&self.path(prompt), &bytes)
    }
}
