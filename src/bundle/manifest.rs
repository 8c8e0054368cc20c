//! The bundle's `manifest.json`: what is in a bundle and how to use it.
//!
//! The schema is the bundle contract in `onnx/README.md` (format version 1), written by
//! `klein-export convert`. Loading is forward compatible: fields this runtime does not know are
//! ignored, but every field it uses is required. [`Manifest::load`] refuses a bundle whose format
//! version it does not know, whose manifest is not valid, whose numbers contradict each other, or
//! whose files are missing or have the wrong size. Their SHA-256 is checked apart
//! ([`super::stamp`]: slow on multi-GB bundles), and each graph against its [`GraphSpec`] once
//! loaded ([`super::contract`]). [`Manifest::from_json_bytes`] parses and checks a manifest's text
//! alone.
//!
//! The configuration of each pipeline stage is the stage's own type ([`TokenizerSpec`],
//! [`ShiftConfig`], [`ReferenceLimits`]...): the manifest holds them, the stages do not know it.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Component as PathComponent, Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::buckets::StaticShapes;
use super::component::Component;
use super::lora_targets::{self, LoraTarget};
use crate::error::{KleinError, Result};
use crate::limits::{
    MAX_GUIDANCE, MAX_SEQUENCE_LENGTH, MAX_SIDE, MAX_STEPS, MAX_TIME_OFFSET_SCALE, MIN_SIDE,
};
use crate::runtime::{Dtype, OrtVersion, RuntimeInfo};
use crate::stages::preview::PreviewSpec;
use crate::stages::reference::ReferenceLimits;
use crate::stages::schedule::{EmpiricalMu, ShiftConfig};
use crate::stages::tokenize::TokenizerSpec;

/// The bundle format version this runtime writes and reads (`format_version` in the manifest).
pub const FORMAT_VERSION: u32 = 1;
/// Every bundle format version this runtime can read.
pub const SUPPORTED_FORMAT_VERSIONS: &[u32] = &[FORMAT_VERSION];
/// File name of the manifest inside a bundle directory.
pub const MANIFEST_FILE: &str = "manifest.json";

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
    /// The step-preview map (latents to RGB) fitted on the VAE; absent in bundles exported before
    /// previews existed (`klein-export preview` adds it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preview: Option<PreviewSpec>,
    /// Every file of the bundle (relative path) with its size and SHA-256.
    pub files: BTreeMap<String, FileEntry>,
    /// What wrote the bundle.
    pub exporter: ExporterInfo,
    /// Oldest ONNX Runtime the graphs were checked with, e.g. `"1.31.0"`; a bundle is refused
    /// by an older library ([`Manifest::check_runtime`]).
    pub min_onnxruntime_version: OrtVersion,
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
    /// The KV variant (`Flux2KleinKVPipeline`): the transformer graph extracts the references'
    /// attention K/V on the first step and takes them on the later ones ([`super::kv`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub kv_cache: bool,
    /// LoRAs merged into the transformer's weights at export (`klein-export convert --lora`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub loras: Vec<ExportedLora>,
    /// The single file the transformer's weights were exported from (`klein-export convert
    /// --transformer`): a fine-tune on the base checkpoint's architecture.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transformer_file: Option<SourceFile>,
}

/// A file a bundle was exported from: its name and sha256.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceFile {
    pub file: String,
    pub sha256: String,
}

/// `model.loras[]`: a LoRA merged at export, and its scale.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportedLora {
    #[serde(flatten)]
    pub source: SourceFile,
    pub scale: f64,
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
    /// The VAE config's `sample_size`: the side in pixels of a tile of tiled decoding and
    /// encoding. Bundles exported before it was recorded get diffusers' default, 1024.
    #[serde(default = "default_vae_sample_size")]
    pub sample_size: usize,
}

fn default_vae_sample_size() -> usize {
    1024
}

/// `latents`: the packed latent layout.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct LatentsSpec {
    /// Channels of a packed latent token (`latent_channels * patch_size^2`).
    pub channels: usize,
    /// Output sides are floored to a multiple of this (`spatial_factor * patch_size`).
    pub pixel_multiple: u32,
}

impl LatentsSpec {
    /// The packed latents' shape for `batch` images of `height` x `width` pixels:
    /// `[B, channels, H/m, W/m]` (`m` = `pixel_multiple`).
    pub fn latents_shape(&self, batch: usize, height: usize, width: usize) -> [usize; 4] {
        let m = self.pixel_multiple as usize;
        [batch, self.channels, height / m, width / m]
    }

    /// The decoded images' shape for `batch` packed latents of `h` x `w` cells: `[B, 3, m*h, m*w]`.
    pub fn image_shape(&self, batch: usize, h: usize, w: usize) -> [usize; 4] {
        let m = self.pixel_multiple as usize;
        [batch, 3, m * h, m * w]
    }
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

/// The scheduler class a manifest must name (`scheduler.class`).
const SCHEDULER_CLASS: &str = "FlowMatchEulerDiscreteScheduler";

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
    /// The graph of `component`.
    pub fn get(&self, component: Component) -> &GraphSpec {
        match component {
            Component::TextEncoder => &self.text_encoder,
            Component::Transformer => &self.transformer,
            Component::VaeEncoder => &self.vae_encoder,
            Component::VaeDecoder => &self.vae_decoder,
        }
    }

    /// Every graph with its component, in pipeline order.
    pub fn iter(&self) -> impl Iterator<Item = (Component, &GraphSpec)> {
        Component::ALL.into_iter().map(|c| (c, self.get(c)))
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
    /// The transformer's linear layers by diffusers module name, for LoRAs merged at load time
    /// (absent in bundles exported before klein had LoRAs, and in quantized ones).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_targets: Option<BTreeMap<String, LoraTarget>>,
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
    /// int8 codes in [-64, 64] (`--reduce-range`, 7 bits): products of uint8 activations and these
    /// weights cannot saturate 16-bit pair sums on CPUs without VNNI. Absent (and not written)
    /// when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reduce_range: bool,
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

impl GraphSpec {
    /// The fixed size of axis `axis` of the input or output `name` (negative: from the end), if
    /// the contract fixes it.
    pub(super) fn fixed_dim(&self, name: &str, axis: isize) -> Option<u64> {
        let tensor = self
            .inputs
            .iter()
            .chain(&self.outputs)
            .find(|t| t.name == name)?;
        let index = if axis < 0 {
            tensor.shape.len().checked_sub(axis.unsigned_abs())?
        } else {
            axis as usize
        };
        match tensor.shape.get(index)? {
            DimSpec::Fixed(n) => Some(*n),
            DimSpec::Named(_) => None,
        }
    }
}

impl Manifest {
    /// The graphs' fixed widths against the architecture the manifest states: a manifest that
    /// names one model's widths over another model's graphs (a 4B manifest on 9B graphs) would load
    /// and run, with prompt caches and LoRAs checked against the wrong numbers.
    fn graph_width_problems(&self) -> Vec<String> {
        let g = &self.graphs;
        let checks = [
            (
                "text_encoder",
                &g.text_encoder,
                "prompt_embeds",
                -1,
                self.text_encoder.embed_dim,
                "text_encoder.embed_dim",
            ),
            (
                "transformer",
                &g.transformer,
                "prompt_embeds",
                -1,
                self.transformer.joint_attention_dim,
                "transformer.joint_attention_dim",
            ),
            (
                "transformer",
                &g.transformer,
                "latents",
                -1,
                self.latents.channels,
                "latents.channels",
            ),
            (
                "vae_decoder",
                &g.vae_decoder,
                "latents",
                1,
                self.latents.channels,
                "latents.channels",
            ),
            (
                "vae_encoder",
                &g.vae_encoder,
                "latents",
                1,
                self.latents.channels,
                "latents.channels",
            ),
        ];
        checks
            .into_iter()
            .filter_map(|(graph, spec, tensor, axis, want, what)| {
                let got = spec.fixed_dim(tensor, axis)?;
                (got != want as u64).then(|| {
                    format!(
                        "graphs.{graph} `{tensor}` is {got} wide but {what} is {want}: the \
                         manifest does not describe these graphs (another model's widths?)"
                    )
                })
            })
            .collect()
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
        let reading = |source| KleinError::Io {
            path: manifest_path.clone(),
            action: "reading the manifest",
            source,
        };
        match std::fs::metadata(&manifest_path) {
            Ok(meta) if meta.is_file() => {}
            Ok(_) => {
                return Err(bundle_error(
                    &manifest_path,
                    "is not a file; a bundle's manifest.json is the JSON file `klein-export convert` writes"
                        .to_string(),
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(bundle_error(
                    bundle_dir,
                    format!("has no {MANIFEST_FILE}; is this a klein bundle written by `klein-export convert`?"),
                ))
            }
            // Permission denied and the like: the system's reason, not "no manifest".
            Err(e) => return Err(reading(e)),
        }
        let bytes = std::fs::read(&manifest_path).map_err(reading)?;
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
        // Not an object at all (`[]`): said so, not as serde names the probe's type.
        let value: serde_json::Value = serde_json::from_slice(bytes)
            .map_err(|e| bundle_error(format!("not valid JSON: {e}")))?;
        if !value.is_object() {
            return Err(bundle_error(
                "is not a JSON object; a manifest.json is the object `klein-export convert` writes"
                    .to_string(),
            ));
        }
        let probe: VersionProbe = serde_json::from_value(value)
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

    /// Refuses an ONNX Runtime library older than the bundle's `min_onnxruntime_version` (its
    /// graphs may use operators or attributes that release lacks; it would fail later, or worse,
    /// run them differently). `bundle_dir` names the bundle in the error.
    pub fn check_runtime(&self, runtime: &RuntimeInfo, bundle_dir: &Path) -> Result<()> {
        let needed = self.min_onnxruntime_version;
        let Some(version) = runtime.version.filter(|&version| version < needed) else {
            return Ok(()); // new enough, or a build that reports no release (not checked)
        };
        Err(KleinError::Bundle {
            path: bundle_dir.join(MANIFEST_FILE),
            reason: format!(
                "needs ONNX Runtime {needed} or newer (min_onnxruntime_version), but the library in \
                 use is {version} ({}, {}); use ONNX Runtime {needed} or newer (ORT_DYLIB_PATH, the \
                 CLI's --ort-lib, Python's ort_lib, the C API's ort_library)",
                runtime.library.display(),
                runtime.source
            ),
        })
    }

    /// Numbers that must agree with each other for the pipeline's arithmetic to be right.
    fn check_consistency(&self) -> std::result::Result<(), String> {
        let te = &self.text_encoder;
        let tr = &self.transformer;
        let vae = &self.vae;
        let mut problems = Vec::new();
        let length = self.tokenizer.max_sequence_length;
        if length == 0 || length > MAX_SEQUENCE_LENGTH {
            problems.push(format!(
                "tokenizer.max_sequence_length {length} is outside 1..={MAX_SEQUENCE_LENGTH} \
                 (FLUX.2-klein uses 512)"
            ));
        }
        if self.scheduler.class_name != SCHEDULER_CLASS {
            problems.push(format!(
                "scheduler.class {:?} is not {SCHEDULER_CLASS:?}, the only scheduler this runtime implements",
                self.scheduler.class_name
            ));
        }
        if tr.num_attention_heads == 0 || tr.attention_head_dim == 0 {
            problems.push(format!(
                "transformer.num_attention_heads {} and attention_head_dim {} must be non-zero",
                tr.num_attention_heads, tr.attention_head_dim
            ));
        }
        if vae.sample_size == 0 {
            problems.push(
                "vae.sample_size is 0 (the VAE's tile side in pixels, 1024 in FLUX.2)".to_string(),
            );
        }
        let model = &self.model;
        if model.default_steps == 0 || model.default_steps as usize > MAX_STEPS {
            problems.push(format!(
                "model.default_steps {} is outside 1..={MAX_STEPS}",
                model.default_steps
            ));
        }
        if !(model.default_guidance.is_finite()
            && (0.0..=MAX_GUIDANCE).contains(&model.default_guidance))
        {
            problems.push(format!(
                "model.default_guidance {} is outside 0..={MAX_GUIDANCE}",
                model.default_guidance
            ));
        }
        for (name, side) in [
            ("default_width", model.default_width),
            ("default_height", model.default_height),
        ] {
            if !(MIN_SIDE..=MAX_SIDE).contains(&side) {
                problems.push(format!(
                    "model.{name} {side} is outside {MIN_SIDE}..={MAX_SIDE} pixels"
                ));
            }
        }
        // Found here, in the file (the schedule refuses it too, without naming the file).
        if self.scheduler.shift.num_train_timesteps == 0 {
            problems.push("scheduler.num_train_timesteps is 0 (FLUX.2 trains on 1000)".to_string());
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
        let limits = &self.references.limits;
        if limits.max_aspect_ratio < 1.0 || limits.max_area == 0 || limits.min_side == 0 {
            problems.push(format!(
                "references.max_aspect_ratio {}, max_area {} and min_side {} must be at least 1 \
                 (diffusers uses 8, 1048576 and 64): no reference would fit",
                limits.max_aspect_ratio, limits.max_area, limits.min_side
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
        if let Some(targets) = &self.graphs.transformer.lora_targets {
            let size = |file: &str| self.files.get(file).map(|entry| entry.bytes);
            problems.extend(lora_targets::problems(targets, size));
        }
        problems.extend(self.graph_width_problems());
        problems.extend(self.kv_problems()); // bundle/kv.rs
        if let Some(preview) = &self.preview {
            let cells = vae.patch_size.saturating_mul(vae.patch_size);
            problems.extend(preview.problems(self.latents.channels, cells));
        }
        if let Some(shapes) = &self.static_shapes {
            problems.extend(shapes.problems(
                self.latents.pixel_multiple,
                self.tokenizer.max_sequence_length,
                MAX_SIDE,
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
            .chain(self.graphs.iter().map(|(c, g)| (c.as_str(), &g.file)))
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
                    .all(|c| matches!(c, PathComponent::Normal(_)))
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

/// `"1"`, or `"1, 2"` when several versions are readable.
pub(crate) fn supported_versions() -> String {
    SUPPORTED_FORMAT_VERSIONS
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}
