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
//! The schema is here (serde types); the checks of loading are in `checks.rs`.
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

mod checks;

pub(crate) use checks::supported_versions;

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
    /// The model family: FLUX.2-klein (the default, absent in older manifests) or FLUX.3 Image
    /// Klein. The pipeline follows it.
    #[serde(default, skip_serializing_if = "ModelFamily::is_flux2")]
    pub family: ModelFamily,
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

/// `model.family`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum ModelFamily {
    /// FLUX.2-klein (`Flux2KleinPipeline`, `Flux2KleinKVPipeline`).
    #[default]
    #[serde(rename = "flux2")]
    Flux2,
    /// FLUX.3 Image Klein (`Flux3ModularPipeline`, `Flux3DistilledModularPipeline`).
    #[serde(rename = "flux3")]
    Flux3,
}

impl ModelFamily {
    fn is_flux2(&self) -> bool {
        *self == ModelFamily::Flux2
    }

    /// Most image tokens (output and references) of one transformer call.
    pub fn max_image_tokens(self) -> usize {
        match self {
            ModelFamily::Flux2 => crate::limits::MAX_IMAGE_TOKENS,
            ModelFamily::Flux3 => crate::limits::FLUX3_MAX_IMAGE_TOKENS,
        }
    }

    /// The family's name as users know it.
    pub fn label(self) -> &'static str {
        match self {
            ModelFamily::Flux2 => "FLUX.2-klein",
            ModelFamily::Flux3 => "FLUX.3 Image Klein",
        }
    }
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
    /// FLUX.3: a flow-map (step-distilled) transformer, which also takes the timestep each step
    /// jumps to (`target_timestep`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub flow_map: bool,
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
        let checks = [
            (
                Component::TextEncoder,
                "prompt_embeds",
                -1,
                self.text_encoder.embed_dim,
                "text_encoder.embed_dim",
            ),
            (
                Component::Transformer,
                "prompt_embeds",
                -1,
                self.transformer.joint_attention_dim,
                "transformer.joint_attention_dim",
            ),
            (
                Component::Transformer,
                "latents",
                -1,
                self.latents.channels,
                "latents.channels",
            ),
            (
                Component::VaeDecoder,
                "latents",
                1,
                self.latents.channels,
                "latents.channels",
            ),
            (
                Component::VaeEncoder,
                "latents",
                1,
                self.latents.channels,
                "latents.channels",
            ),
        ];
        checks
            .into_iter()
            .filter_map(|(graph, tensor, axis, want, what)| {
                let got = self.graphs.get(graph).fixed_dim(tensor, axis)?;
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
