//! The bundle's `manifest.json`: what is in a bundle and how to use it.
//!
//! The schema is the bundle contract in `onnx/README.md` (format version 1), written by
//! `klein-export convert`. Loading is forward compatible: fields this runtime does not know are
//! ignored, but every field it uses is required. [`Manifest::load`] refuses a bundle whose format
//! version it does not know, whose manifest is not valid, whose numbers contradict each other, or
//! whose files are missing or have the wrong size; [`Manifest::verify_hashes`] also checks their
//! SHA-256 (slow on multi-GB bundles, so it is separate), and [`Manifest::verify_hashes_cached`]
//! skips that while a verification stamp shows the files unchanged (what `Pipeline::load` does).
//! [`Manifest::from_json_bytes`] parses and checks a manifest's text alone.
//!
//! The I/O contract of each graph ([`GraphSpec`]) is checked against the loaded ONNX graph by
//! `runtime::Graph::check_io`, and the graph's `klein.*` metadata by [`GraphSpec::check_metadata`].

use std::collections::BTreeMap;
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::buckets::StaticShapes;
use crate::error::{KleinError, Result};
use crate::output::write_atomic;
use crate::reference::ReferenceLimits;
use crate::schedule::{EmpiricalMu, ShiftConfig};

/// The bundle format version this runtime writes and reads (`format_version` in the manifest).
pub const FORMAT_VERSION: u32 = 1;
/// Every bundle format version this runtime can read.
pub const SUPPORTED_FORMAT_VERSIONS: &[u32] = &[FORMAT_VERSION];
/// File name of the manifest inside a bundle directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// Metadata key naming the component a graph implements (`text_encoder`, `transformer`, ...).
pub const META_COMPONENT: &str = "klein.component";
/// Metadata key holding the graph's weight precision (`fp32`, `fp16`, `bf16`).
pub const META_PRECISION: &str = "klein.precision";
/// Metadata key holding the quantization scheme (`none`, or the scheme as JSON).
pub const META_QUANTIZATION: &str = "klein.quantization";
/// Metadata key holding the bundle format version the graph was exported for.
pub const META_FORMAT_VERSION: &str = "klein.format_version";

/// Read buffer for hashing: large enough that hashing, not system calls, sets the pace.
const HASH_BUFFER_BYTES: usize = 1 << 20;
/// Largest `references.time_offset_scale` (in size): reference `i` gets time coordinate
/// `scale * (i + 1)`, and there are at most `MAX_IMAGE_TOKENS` references (one token each), so the
/// coordinates fit in the int64 position ids.
const MAX_TIME_OFFSET_SCALE: u64 = i64::MAX as u64 / (crate::pipeline::MAX_IMAGE_TOKENS as u64 + 1);
/// Folder of the verification stamps inside the cache directory ([`default_cache_dir`]).
const STAMP_DIR: &str = "verified";
/// Files modified less than this long before a verification started are not stamped. File systems
/// take modification times from a coarse clock, so a file rewritten just after it was hashed can
/// keep the time the stamp recorded ("racy" files, in git's words). Such a bundle is hashed again
/// on its next load, and stamped then.
const RACY_WINDOW: Duration = Duration::from_secs(2);

/// The whole `manifest.json` of a bundle.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Manifest {
    /// Bundle format version; only [`SUPPORTED_FORMAT_VERSIONS`] are accepted.
    pub format_version: u32,
    /// Which model this is and its generation defaults.
    pub model: ModelInfo,
    /// How prompts become token ids.
    pub tokenizer: TokenizerSpec,
    /// Architecture numbers of the text encoder (Qwen3).
    pub text_encoder: TextEncoderSpec,
    /// Architecture numbers of the transformer (Flux2 MM-DiT).
    pub transformer: TransformerSpec,
    /// Architecture numbers of the VAE.
    pub vae: VaeSpec,
    /// Layout of the packed latents the transformer works on.
    pub latents: LatentsSpec,
    /// Limits and position offsets of reference images.
    pub references: ReferencesSpec,
    /// The flow-matching scheduler's configuration.
    pub scheduler: SchedulerSpec,
    /// The four ONNX graphs and their I/O contracts.
    pub graphs: GraphsSpec,
    /// Fixed-shape graphs per output size (`klein-export convert --static-shapes`); absent for
    /// the usual dynamic bundles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub static_shapes: Option<StaticShapes>,
    /// Every file of the bundle (relative path) with its size and SHA-256.
    pub files: BTreeMap<String, FileEntry>,
    /// What wrote the bundle.
    pub exporter: ExporterInfo,
    /// Oldest ONNX Runtime the graphs were checked with, e.g. `"1.31.0"`.
    pub min_onnxruntime_version: String,
}

/// `model`: identity of the checkpoint and its generation defaults.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelInfo {
    /// Free text, e.g. `"FLUX.2-klein-4B"`.
    pub name: String,
    /// Which published model (or a tiny test model) this is.
    pub variant: ModelVariant,
    /// Step-distilled (4 steps, no guidance) rather than a base checkpoint.
    pub is_distilled: bool,
    /// Default number of denoising steps (4 distilled, 50 base).
    pub default_steps: u32,
    /// Default guidance scale (1.0 distilled: no classifier-free guidance; 4.0 base).
    pub default_guidance: f64,
    /// Default output width in pixels.
    pub default_width: u32,
    /// Default output height in pixels.
    pub default_height: u32,
}

/// `model.variant`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ModelVariant {
    /// FLUX.2-klein 4B.
    #[serde(rename = "4b")]
    Klein4B,
    /// FLUX.2-klein 9B.
    #[serde(rename = "9b")]
    Klein9B,
    /// A tiny random-weight model for tests.
    #[serde(rename = "tiny")]
    Tiny,
    /// Any other checkpoint with this architecture.
    #[serde(rename = "custom")]
    Custom,
}

/// `tokenizer`: how a prompt becomes `input_ids` and `attention_mask` (see `tokenize`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenizerSpec {
    /// Hugging Face `tokenizers` file inside the bundle.
    pub file: String,
    /// Chat-template text before the user's prompt.
    pub prompt_prefix: String,
    /// Chat-template text after the user's prompt.
    pub prompt_suffix: String,
    /// The padding token's text (`<|endoftext|>` for Qwen3).
    pub pad_token: String,
    /// The padding token's id (151643 for Qwen3).
    pub pad_token_id: u32,
    /// Which side padding goes on.
    pub padding_side: PaddingSide,
    /// Every prompt is truncated and padded to exactly this many tokens (512 for klein).
    pub max_sequence_length: usize,
    /// Whether the tokenizer's post-processor adds its special tokens (false for klein).
    pub add_special_tokens: bool,
}

/// `tokenizer.padding_side`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PaddingSide {
    /// Pads before the prompt.
    Left,
    /// Pads after the prompt (the Qwen3 default).
    Right,
}

/// `text_encoder`: Qwen3 numbers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TextEncoderSpec {
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Decoder layers of the full checkpoint.
    pub num_hidden_layers: usize,
    /// Decoder layers kept in the graph (the last one used).
    pub layers_in_graph: usize,
    /// 1-based decoder layers whose outputs are concatenated, e.g. `[9, 18, 27]`.
    pub hidden_layers: Vec<usize>,
    /// Width of `prompt_embeds`: `hidden_size * hidden_layers.len()`.
    pub embed_dim: usize,
}

/// `transformer`: Flux2 MM-DiT numbers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TransformerSpec {
    /// Channels of a packed latent token (128).
    pub in_channels: usize,
    /// Double-stream blocks.
    pub num_layers: usize,
    /// Single-stream blocks.
    pub num_single_layers: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// Width of one head.
    pub attention_head_dim: usize,
    /// Width of `prompt_embeds` the transformer expects.
    pub joint_attention_dim: usize,
    /// RoPE widths of the (T, H, W, L) position axes; they sum to `attention_head_dim`.
    pub axes_dims_rope: Vec<usize>,
    /// RoPE base.
    pub rope_theta: f64,
    /// Whether the model takes a guidance embedding (false for klein).
    pub guidance_embeds: bool,
}

/// `vae`: AutoencoderKLFlux2 numbers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VaeSpec {
    /// Channels of the VAE latent before patchifying (32).
    pub latent_channels: usize,
    /// Side of the square patch folded into channels (2).
    pub patch_size: usize,
    /// Pixels per VAE latent cell along one side (8).
    pub spatial_factor: usize,
    /// Epsilon of the latent BatchNorm statistics.
    pub batch_norm_eps: f64,
    /// Channel widths of the VAE blocks.
    pub block_out_channels: Vec<usize>,
}

/// `latents`: the packed latent layout.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LatentsSpec {
    /// Channels of a packed latent token (`latent_channels * patch_size^2`).
    pub channels: usize,
    /// Output sides are floored to a multiple of this (`spatial_factor * patch_size`).
    pub pixel_multiple: u32,
}

/// `references`: limits on reference images and their position-id offsets.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReferencesSpec {
    /// `min_side`, `max_aspect_ratio`, `max_area`, as `reference` uses them.
    #[serde(flatten)]
    pub limits: ReferenceLimits,
    /// Reference `i` (0-based) gets time coordinate `scale + scale * i`.
    pub time_offset_scale: i64,
}

/// `scheduler`: FlowMatchEulerDiscreteScheduler configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SchedulerSpec {
    /// Scheduler class name, `FlowMatchEulerDiscreteScheduler`.
    #[serde(rename = "class")]
    pub class_name: String,
    /// `num_train_timesteps`, `shift`, `use_dynamic_shifting`, `time_shift_type`, and the options
    /// this runtime refuses when they are on (`shift_terminal`, `use_karras_sigmas`, ...).
    #[serde(flatten)]
    pub shift: ShiftConfig,
    /// Coefficients of `compute_empirical_mu`.
    pub empirical_mu: EmpiricalMu,
}

/// `graphs`: the four graphs of a bundle.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GraphsSpec {
    /// Prompt tokens to `prompt_embeds`.
    pub text_encoder: GraphSpec,
    /// One velocity prediction.
    pub transformer: GraphSpec,
    /// Reference image to normalised, patchified latents.
    pub vae_encoder: GraphSpec,
    /// Normalised, patchified latents to image.
    pub vae_decoder: GraphSpec,
}

impl GraphsSpec {
    /// Every graph with its component name (the `klein.component` it must carry), in pipeline
    /// order.
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &GraphSpec)> {
        [
            ("text_encoder", &self.text_encoder),
            ("transformer", &self.transformer),
            ("vae_encoder", &self.vae_encoder),
            ("vae_decoder", &self.vae_decoder),
        ]
        .into_iter()
    }
}

/// One graph: its file, precision and I/O contract.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GraphSpec {
    /// The `.onnx` file inside the bundle.
    pub file: String,
    /// Precision of the weights.
    pub precision: Precision,
    /// Weight quantization, if any.
    pub quantization: Option<QuantizationSpec>,
    /// Inputs the runtime feeds, by name.
    pub inputs: Vec<TensorSpec>,
    /// Outputs the runtime reads, by name.
    pub outputs: Vec<TensorSpec>,
}

/// `graphs.*.precision`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// 32-bit float.
    Fp32,
    /// IEEE half precision.
    Fp16,
    /// bfloat16.
    Bf16,
}

impl Precision {
    /// The name used in the manifest and in `klein.precision` metadata.
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `graphs.*.quantization` when not null, e.g. `{"method": "MatMulNBits", "bits": 8, ...}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QuantizationSpec {
    /// Quantizer used, e.g. `MatMulNBits` or `QDQ`.
    pub method: String,
    /// Bits per weight.
    pub bits: u32,
    /// Weights per quantization block.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// Symmetric (no zero point) quantization.
    #[serde(default)]
    pub symmetric: Option<bool>,
    /// ORT's `accuracy_level` for MatMulNBits.
    #[serde(default)]
    pub accuracy_level: Option<u32>,
    /// Operator types that were quantized.
    #[serde(default)]
    pub op_types: Option<Vec<String>>,
    /// Any other field the exporter wrote, kept as is.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// One input or output of a graph.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Tensor name in the graph.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions: fixed sizes or named dynamic ones (`batch`, `seq`, `tokens`...).
    pub shape: Vec<DimSpec>,
}

/// Element type of a graph input or output, with the names the manifest uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 32-bit float.
    Float32,
    /// IEEE half precision.
    Float16,
    /// bfloat16.
    Bfloat16,
    /// 64-bit float.
    Float64,
    /// 64-bit signed integer.
    Int64,
    /// 32-bit signed integer.
    Int32,
    /// 8-bit signed integer.
    Int8,
    /// 8-bit unsigned integer.
    Uint8,
    /// Boolean.
    Bool,
}

impl Dtype {
    /// The name used in the manifest (`float32`, `int64`...).
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::Float32 => "float32",
            Dtype::Float16 => "float16",
            Dtype::Bfloat16 => "bfloat16",
            Dtype::Float64 => "float64",
            Dtype::Int64 => "int64",
            Dtype::Int32 => "int32",
            Dtype::Int8 => "int8",
            Dtype::Uint8 => "uint8",
            Dtype::Bool => "bool",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One dimension of a [`TensorSpec`] shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DimSpec {
    /// A size fixed at export time, e.g. `128`.
    Fixed(u64),
    /// A dynamic size, by its contract name (`batch`, `seq`, `tokens`, `height`...).
    Named(String),
}

impl fmt::Display for DimSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DimSpec::Fixed(n) => write!(f, "{n}"),
            DimSpec::Named(name) => f.write_str(name),
        }
    }
}

/// `files.<name>`: size and hash of one bundle file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FileEntry {
    /// Exact size in bytes.
    pub bytes: u64,
    /// SHA-256 of the contents, 64 hex digits.
    pub sha256: String,
}

/// `exporter`: the tool and library versions that wrote the bundle.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ExporterInfo {
    /// `klein-export`.
    pub name: String,
    /// Its version.
    pub version: String,
    /// ONNX opset of the graphs.
    pub opset: u32,
    /// torch version used for export.
    pub torch: String,
    /// diffusers version used for export.
    pub diffusers: String,
    /// transformers version used for export.
    pub transformers: String,
    /// onnx version used for export.
    pub onnx: String,
}

/// Only the version field, read first so that a manifest from a newer format gets a version error
/// rather than a confusing one about a field that format renamed.
#[derive(Deserialize)]
struct VersionProbe {
    format_version: Option<serde_json::Value>,
}

impl Manifest {
    /// Reads and checks `<bundle_dir>/manifest.json`, then checks that every file it lists exists
    /// with the listed size. Hashes are not checked here: see [`Manifest::verify_hashes`].
    pub fn load(bundle_dir: &Path) -> Result<Manifest> {
        let bundle_error = |path: &Path, reason: String| KleinError::Bundle {
            path: path.to_path_buf(),
            reason,
        };
        if !bundle_dir.is_dir() {
            let reason = if bundle_dir.exists() {
                "is not a directory; pass the bundle directory (the one holding manifest.json)"
            } else {
                "does not exist; pass the directory written by `klein-export convert`"
            };
            return Err(bundle_error(bundle_dir, reason.to_string()));
        }
        let manifest_path = bundle_dir.join(MANIFEST_FILE);
        if !manifest_path.is_file() {
            return Err(bundle_error(
                bundle_dir,
                format!("has no {MANIFEST_FILE}; is this a klein bundle written by `klein-export convert`?"),
            ));
        }
        let bytes = std::fs::read(&manifest_path).map_err(|source| KleinError::Io {
            path: manifest_path.clone(),
            action: "reading the manifest",
            source,
        })?;
        let manifest = Manifest::from_json_bytes(&bytes, &manifest_path)?;
        manifest.check_files(bundle_dir, &manifest_path)?;
        Ok(manifest)
    }

    /// Parses and checks the text of a `manifest.json` without looking at the bundle's files:
    /// the format version, the schema and the consistency of its numbers. `manifest_path` only
    /// names the manifest in errors. [`Manifest::load`] is this plus the file checks.
    pub fn from_json_bytes(bytes: &[u8], manifest_path: &Path) -> Result<Manifest> {
        let bundle_error = |reason: String| KleinError::Bundle {
            path: manifest_path.to_path_buf(),
            reason,
        };
        let probe: VersionProbe = serde_json::from_slice(bytes)
            .map_err(|e| bundle_error(format!("not valid JSON: {e}")))?;
        let supported = supported_versions();
        match probe.format_version {
            None => {
                return Err(bundle_error(format!(
                    "has no `format_version`; this runtime reads format version {supported}"
                )))
            }
            Some(v)
                if v.as_u64().is_some_and(|v| {
                    SUPPORTED_FORMAT_VERSIONS
                        .iter()
                        .any(|&s| u64::from(s) == v)
                }) => {}
            Some(v) => {
                return Err(bundle_error(format!(
                    "format_version {v} is not supported; this runtime reads format version {supported}. \
                     Use a klein release that reads it, or re-export the bundle with a matching klein-export"
                )))
            }
        }

        let manifest: Manifest = serde_json::from_slice(bytes).map_err(|e| {
            bundle_error(format!("does not match the format version 1 schema: {e}"))
        })?;
        manifest.check_consistency().map_err(bundle_error)?;
        Ok(manifest)
    }

    /// [`Manifest::verify_hashes`], skipped when a stamp in `cache_dir` shows that no file changed
    /// since the last successful verification.
    ///
    /// The stamp (`<cache_dir>/verified/<key>.json`, the key a hash of the bundle's canonical path
    /// and of its manifest.json) records each file's size, modification time (ns) and expected
    /// sha256. It is used only when all of them still agree, and written after a verification
    /// that passed, unless a file changed while it was hashed or was modified within 2 s of it
    /// (see `RACY_WINDOW`). `cache_dir` `None`, or a stamp that cannot be read or written, means
    /// hashing every time; failures to write are ignored.
    ///
    /// A stamp catches corruption and ordinary edits (any write updates the modification time),
    /// not an attacker who can also set the time back: use [`Manifest::verify_hashes`] for that.
    pub fn verify_hashes_cached(
        &self,
        bundle_dir: &Path,
        cache_dir: Option<&Path>,
    ) -> Result<Verification> {
        let started = SystemTime::now();
        let stamp_path = cache_dir.and_then(|dir| stamp_path(bundle_dir, dir));
        let before = self.stamp(bundle_dir);
        if let (Some(path), Some(expected)) = (&stamp_path, &before) {
            let stored = std::fs::read(path)
                .ok()
                .and_then(|bytes| serde_json::from_slice::<Stamp>(&bytes).ok());
            if stored.as_ref() == Some(expected) {
                return Ok(Verification {
                    hashed: false,
                    stamp: stamp_path,
                });
            }
        }
        self.verify_hashes(bundle_dir)?;
        let settled = |stamp: &Stamp| {
            let cutoff = started
                .checked_sub(RACY_WINDOW)
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            stamp
                .files
                .values()
                .all(|f| u128::from(f.modified_ns) < cutoff)
        };
        let written = match (stamp_path, before) {
            (Some(path), Some(before))
                if settled(&before) && self.stamp(bundle_dir).as_ref() == Some(&before) =>
            {
                write_stamp(&path, &before).then_some(path)
            }
            _ => None,
        };
        Ok(Verification {
            hashed: true,
            stamp: written,
        })
    }

    /// The stamp this bundle would have now: every file's size and modification time as on disk,
    /// with the manifest's hash. `None` when a time or the bundle's canonical path is unavailable.
    fn stamp(&self, bundle_dir: &Path) -> Option<Stamp> {
        let bundle = std::fs::canonicalize(bundle_dir).ok()?;
        let files = self
            .files
            .iter()
            .map(|(name, entry)| {
                let meta = std::fs::metadata(bundle.join(name)).ok()?;
                let modified = meta.modified().ok()?.duration_since(UNIX_EPOCH).ok()?;
                Some((
                    name.clone(),
                    StampedFile {
                        bytes: meta.len(),
                        modified_ns: u64::try_from(modified.as_nanos()).ok()?,
                        sha256: entry.sha256.to_ascii_lowercase(),
                    },
                ))
            })
            .collect::<Option<BTreeMap<_, _>>>()?;
        Some(Stamp {
            bundle: bundle.to_string_lossy().into_owned(),
            files,
        })
    }

    /// Checks the SHA-256 of every file in `files` against the manifest. Files are hashed in
    /// parallel with a streaming reader; every mismatch is reported, not only the first.
    pub fn verify_hashes(&self, bundle_dir: &Path) -> Result<()> {
        let mismatches: Vec<String> = self
            .files
            .par_iter()
            .map(|(name, entry)| {
                let path = bundle_dir.join(name);
                let found = sha256_file(&path)?;
                Ok((!found.eq_ignore_ascii_case(&entry.sha256)).then(|| {
                    format!(
                        "{name}: sha256 is {found}, manifest.json says {}",
                        entry.sha256
                    )
                }))
            })
            .collect::<Result<Vec<Option<String>>>>()?
            .into_iter()
            .flatten()
            .collect();
        if mismatches.is_empty() {
            Ok(())
        } else {
            Err(KleinError::Bundle {
                path: bundle_dir.to_path_buf(),
                reason: format!(
                    "{} file(s) do not match manifest.json (corrupted or modified; copy or export the bundle again): {}",
                    mismatches.len(),
                    mismatches.join("; ")
                ),
            })
        }
    }

    /// Numbers that must agree with each other for the pipeline's arithmetic to be right.
    fn check_consistency(&self) -> std::result::Result<(), String> {
        let te = &self.text_encoder;
        let tr = &self.transformer;
        let vae = &self.vae;
        let mut problems = Vec::new();
        if self.tokenizer.max_sequence_length == 0 {
            problems.push("tokenizer.max_sequence_length is 0".to_string());
        }
        if self.model.default_steps == 0 {
            problems.push("model.default_steps is 0".to_string());
        }
        if te.hidden_layers.is_empty() {
            problems.push("text_encoder.hidden_layers is empty".to_string());
        }
        if let Some(bad) = te
            .hidden_layers
            .iter()
            .find(|&&k| k == 0 || k > te.layers_in_graph)
        {
            problems.push(format!(
                "text_encoder.hidden_layers has layer {bad}, outside 1..={} (layers_in_graph)",
                te.layers_in_graph
            ));
        }
        if te.layers_in_graph > te.num_hidden_layers {
            problems.push(format!(
                "text_encoder.layers_in_graph {} exceeds num_hidden_layers {}",
                te.layers_in_graph, te.num_hidden_layers
            ));
        }
        // Products and sums of manifest numbers are checked: a hostile manifest must not
        // overflow them (a panic in debug builds, a wrong but accepted value in release builds).
        match te.hidden_size.checked_mul(te.hidden_layers.len()) {
            Some(dim) if dim == te.embed_dim => {}
            product => problems.push(format!(
                "text_encoder.embed_dim {} != hidden_size {} x {} hidden layers{}",
                te.embed_dim,
                te.hidden_size,
                te.hidden_layers.len(),
                if product.is_none() {
                    " (overflows)"
                } else {
                    ""
                }
            )),
        }
        if tr.joint_attention_dim != te.embed_dim {
            problems.push(format!(
                "transformer.joint_attention_dim {} != text_encoder.embed_dim {}",
                tr.joint_attention_dim, te.embed_dim
            ));
        }
        let rope_sum = tr
            .axes_dims_rope
            .iter()
            .try_fold(0usize, |sum, &d| sum.checked_add(d));
        if rope_sum != Some(tr.attention_head_dim) {
            problems.push(format!(
                "transformer.axes_dims_rope {:?} sums to {}, not attention_head_dim {}",
                tr.axes_dims_rope,
                rope_sum.map_or("more than the largest integer".to_string(), |s| s
                    .to_string()),
                tr.attention_head_dim
            ));
        }
        let packed = vae
            .patch_size
            .checked_mul(vae.patch_size)
            .and_then(|p| p.checked_mul(vae.latent_channels));
        if self.latents.channels == 0
            || self.latents.channels != tr.in_channels
            || Some(self.latents.channels) != packed
        {
            problems.push(format!(
                "latents.channels {} must be non-zero and equal transformer.in_channels {} and \
                 vae.latent_channels x patch_size^2 = {}",
                self.latents.channels,
                tr.in_channels,
                packed.map_or("(overflows)".to_string(), |p| p.to_string())
            ));
        }
        let multiple = vae.spatial_factor.checked_mul(vae.patch_size);
        if self.latents.pixel_multiple == 0
            || Some(self.latents.pixel_multiple as usize) != multiple
        {
            problems.push(format!(
                "latents.pixel_multiple {} must be non-zero and equal vae.spatial_factor x patch_size = {}",
                self.latents.pixel_multiple,
                multiple.map_or("(overflows)".to_string(), |m| m.to_string())
            ));
        }
        // Reference i gets time coordinate `scale * (i + 1)`; the token budget bounds i.
        let scale = self.references.time_offset_scale;
        if scale.unsigned_abs() > MAX_TIME_OFFSET_SCALE {
            problems.push(format!(
                "references.time_offset_scale {scale} is out of range: at most {MAX_TIME_OFFSET_SCALE} \
                 in size (diffusers uses 10)"
            ));
        }
        if let Some(shapes) = &self.static_shapes {
            problems.extend(shapes.problems(
                self.latents.pixel_multiple,
                self.tokenizer.max_sequence_length,
                crate::pipeline::MAX_SIDE,
            ));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(format!("inconsistent numbers: {}", problems.join("; ")))
        }
    }

    /// Every listed file exists with its listed size; every file the pipeline reads is listed.
    fn check_files(&self, bundle_dir: &Path, manifest_path: &Path) -> Result<()> {
        let bundle_error = |path: PathBuf, reason: String| KleinError::Bundle { path, reason };
        let needed = std::iter::once(("tokenizer", &self.tokenizer.file))
            .chain(self.graphs.iter().map(|(name, g)| (name, &g.file)))
            .chain(self.static_shapes.iter().flat_map(StaticShapes::files));
        for (what, file) in needed {
            if !self.files.contains_key(file) {
                return Err(bundle_error(
                    manifest_path.to_path_buf(),
                    format!(
                        "{what} file `{file}` is not listed in `files`, so it cannot be checked"
                    ),
                ));
            }
        }
        for (name, entry) in &self.files {
            let relative = Path::new(name);
            if name.is_empty()
                || !relative
                    .components()
                    .all(|c| matches!(c, Component::Normal(_)))
            {
                return Err(bundle_error(
                    manifest_path.to_path_buf(),
                    format!("`files` entry `{name}` is not a plain path inside the bundle"),
                ));
            }
            if entry.sha256.len() != 64 || !entry.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bundle_error(
                    manifest_path.to_path_buf(),
                    format!(
                        "files.{name}.sha256 `{}` is not 64 hex digits",
                        entry.sha256
                    ),
                ));
            }
            let path = bundle_dir.join(relative);
            let meta = match std::fs::metadata(&path) {
                Ok(meta) => meta,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(bundle_error(
                        path,
                        "is listed in manifest.json but missing; copy or export the bundle again"
                            .to_string(),
                    ))
                }
                Err(source) => {
                    return Err(KleinError::Io {
                        path,
                        action: "reading file metadata",
                        source,
                    })
                }
            };
            if !meta.is_file() {
                return Err(bundle_error(
                    path,
                    "is listed in manifest.json but is not a file".to_string(),
                ));
            }
            if meta.len() != entry.bytes {
                let hint = if meta.len() < entry.bytes {
                    "truncated: an interrupted copy or download?"
                } else {
                    "larger than exported: modified or replaced?"
                };
                return Err(bundle_error(
                    path,
                    format!(
                        "is {} bytes, manifest.json says {} ({hint})",
                        meta.len(),
                        entry.bytes
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl GraphSpec {
    /// Checks the `klein.*` metadata of the loaded graph file `path` against this spec:
    /// `klein.component` must be `component`, `klein.format_version` a supported version, and
    /// `klein.precision` / `klein.quantization` must agree with the manifest.
    pub fn check_metadata(
        &self,
        component: &str,
        metadata: &BTreeMap<String, String>,
        path: &Path,
    ) -> Result<()> {
        let bundle_error = |reason: String| KleinError::Bundle {
            path: path.to_path_buf(),
            reason,
        };
        let get = |key: &str| {
            metadata.get(key).ok_or_else(|| {
                bundle_error(format!(
                    "graph has no `{key}` metadata; it was not written by klein-export (expected the `{component}` graph)"
                ))
            })
        };
        let found = get(META_COMPONENT)?;
        if found != component {
            return Err(bundle_error(format!(
                "{META_COMPONENT} is `{found}`, expected `{component}` (graph files swapped?)"
            )));
        }
        let version = get(META_FORMAT_VERSION)?;
        if !SUPPORTED_FORMAT_VERSIONS
            .iter()
            .any(|v| v.to_string() == *version)
        {
            return Err(bundle_error(format!(
                "{META_FORMAT_VERSION} is `{version}`; this runtime reads format version {}",
                supported_versions()
            )));
        }
        let precision = get(META_PRECISION)?;
        if precision != self.precision.as_str() {
            return Err(bundle_error(format!(
                "{META_PRECISION} is `{precision}`, manifest.json says `{}`",
                self.precision
            )));
        }
        let quantization = get(META_QUANTIZATION)?;
        let graph_quantized = quantization != "none";
        if graph_quantized != self.quantization.is_some() {
            let declared = self
                .quantization
                .as_ref()
                .map_or("none".to_string(), |q| q.method.clone());
            return Err(bundle_error(format!(
                "{META_QUANTIZATION} is `{quantization}`, manifest.json says `{declared}`"
            )));
        }
        Ok(())
    }
}

/// The result of [`Manifest::verify_hashes_cached`] (which fails when a file does not match).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Verification {
    /// The files were hashed; false when a stamp showed them unchanged since they last were.
    pub hashed: bool,
    /// The stamp that vouched for the files or was written after hashing them; `None` when there
    /// is no cache directory, the stamp could not be written, or a file was modified too recently.
    pub stamp: Option<PathBuf>,
}

/// What a verification stamp records. A stamp vouches for a bundle only if it equals the one
/// computed now ([`Manifest::stamp`]).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Stamp {
    /// The bundle's canonical path.
    bundle: String,
    /// Every file of the manifest's `files`.
    files: BTreeMap<String, StampedFile>,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct StampedFile {
    bytes: u64,
    /// Modification time, nanoseconds since the Unix epoch.
    modified_ns: u64,
    /// The sha256 manifest.json gives (lower case), which the file matched.
    sha256: String,
}

/// Where klein keeps its caches (verification stamps): `$KLEIN_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/klein`, else `$HOME/.cache/klein`, else `%LOCALAPPDATA%\klein`; `None` when
/// none of these variables is set.
pub fn default_cache_dir() -> Option<PathBuf> {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("KLEIN_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("klein")))
        .or_else(|| var("HOME").map(|d| d.join(".cache").join("klein")))
        .or_else(|| var("LOCALAPPDATA").map(|d| d.join("klein")))
}

/// `<cache_dir>/verified/<sha256 of the canonical bundle path and of manifest.json>.json`, or
/// `None` when the bundle's path or manifest cannot be read.
fn stamp_path(bundle_dir: &Path, cache_dir: &Path) -> Option<PathBuf> {
    let bundle = std::fs::canonicalize(bundle_dir).ok()?;
    let manifest = std::fs::read(bundle.join(MANIFEST_FILE)).ok()?;
    let mut hasher = Sha256::new();
    hasher.update(bundle.as_os_str().as_encoded_bytes());
    hasher.update([0]);
    hasher.update(Sha256::digest(&manifest));
    Some(
        cache_dir
            .join(STAMP_DIR)
            .join(format!("{}.json", hex(&hasher.finalize()))),
    )
}

/// Writes a stamp atomically; false on any failure (a stamp only saves time).
fn write_stamp(path: &Path, stamp: &Stamp) -> bool {
    let Ok(bytes) = serde_json::to_vec_pretty(stamp) else {
        return false;
    };
    path.parent()
        .is_some_and(|dir| std::fs::create_dir_all(dir).is_ok())
        && write_atomic(path, &bytes).is_ok()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `"1"`, or `"1, 2"` when several versions are readable.
fn supported_versions() -> String {
    SUPPORTED_FORMAT_VERSIONS
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Lower-case hex SHA-256 of a file, streamed.
fn sha256_file(path: &Path) -> Result<String> {
    let io_error = |source| KleinError::Io {
        path: path.to_path_buf(),
        action: "hashing",
        source,
    };
    let mut file = File::open(path).map_err(io_error)?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; HASH_BUFFER_BYTES];
    loop {
        let n = match file.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_error(e)),
        };
        hasher.update(&buffer[..n]);
    }
    Ok(hex(&hasher.finalize()))
}
