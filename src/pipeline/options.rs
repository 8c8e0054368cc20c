//! How to load a bundle: [`PipelineOptions`], built with its `with_*` methods from `default()`.
use std::path::PathBuf;

use super::lora::LoraSpec;
use crate::runtime::{CoreMlOptions, CudaOptions, Device, RuntimeOptions, SessionConfig};

/// How to load a bundle. Every setting has a `with_*` method; the graphs' session settings
/// (device, threads, provider options) are one [`SessionConfig`].
#[derive(Debug, Clone)]
pub struct PipelineOptions {
    /// Device, threads and provider options of every graph session.
    pub(crate) session: SessionConfig,
    /// Where the ONNX Runtime library comes from.
    pub(crate) runtime: RuntimeOptions,
    /// Keep the text-encoder session loaded after encoding (for many prompts in one process).
    pub(crate) keep_text_encoder: bool,
    /// Release the transformer session before each `generate`'s decode (one image per process).
    pub(crate) release_transformer: bool,
    /// Check the sha256 of every bundle file before loading any graph.
    pub(crate) verify_hashes: bool,
    /// Directory for verification stamps (`None`: [`crate::bundle::default_cache_dir`]).
    pub(crate) cache_dir: Option<PathBuf>,
    /// Directory of the on-disk prompt-embedding cache (`None`: no cache).
    pub(crate) prompt_cache_dir: Option<PathBuf>,
    /// Most MiB the prompt cache's entries may take (`None`: the default).
    pub(crate) prompt_cache_mib: Option<u64>,
    /// LoRAs merged into the transformer ([`crate::pipeline::Pipeline::set_loras`]).
    pub(crate) loras: Vec<LoraSpec>,
    /// Tiled VAE decoding and encoding.
    pub(crate) vae_tiling: VaeTiling,
    /// The VAE's tile side in pixels (`None`: the bundle's `vae.sample_size`).
    pub(crate) vae_tile_size: Option<u32>,
}

/// Tiled VAE decoding and encoding ([`crate::stages::vae_tiling`]), as diffusers'
/// `vae.enable_tiling()`: an image (or reference) larger than the VAE's tile (`vae.sample_size`,
/// 1024 px for FLUX.2) goes through the VAE in overlapping tiles, so the decoder's memory is one
/// tile's. The image differs slightly from an untiled one (blended seams), as in diffusers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VaeTiling {
    /// Never tile.
    Off,
    /// Tile every image with a side larger than the tile, as diffusers with tiling enabled.
    On,
    /// Tile images of more than [`AUTO_TILING_PIXELS`] (and a side larger than the tile):
    /// the default size and below decode whole, exactly as diffusers without tiling.
    #[default]
    Auto,
}

/// Above this many pixels (1024x1024), [`VaeTiling::Auto`] tiles. The real VAE's mid-block
/// attention over 1536x1536 pixels holds a 36864 x 36864 float matrix (5.4 GB) when ONNX Runtime
/// does not fuse it; a 1024x1024 tile holds 1 GB.
pub const AUTO_TILING_PIXELS: u64 = 1024 * 1024;

impl VaeTiling {
    /// Whether an image of `width` x `height` pixels goes through the VAE in tiles of `tile` px.
    pub fn applies(self, width: usize, height: usize, tile: usize) -> bool {
        let larger = width > tile || height > tile;
        match self {
            VaeTiling::Off => false,
            VaeTiling::On => larger,
            VaeTiling::Auto => larger && (width * height) as u64 > AUTO_TILING_PIXELS,
        }
    }
}

impl std::str::FromStr for VaeTiling {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "on" => Ok(VaeTiling::On),
            "off" => Ok(VaeTiling::Off),
            "auto" => Ok(VaeTiling::Auto),
            _ => Err(format!("`{s}`: give on, off or auto")),
        }
    }
}

impl Default for PipelineOptions {
    fn default() -> Self {
        PipelineOptions {
            session: SessionConfig::default(),
            runtime: RuntimeOptions::default(),
            keep_text_encoder: false,
            release_transformer: false,
            verify_hashes: true,
            cache_dir: None,
            prompt_cache_dir: None,
            prompt_cache_mib: None,
            loras: Vec::new(),
            vae_tiling: VaeTiling::default(),
            vae_tile_size: None,
        }
    }
}

impl PipelineOptions {
    /// LoRAs to merge into the transformer when it loads (default: none); see
    /// [`crate::pipeline::Pipeline::set_loras`].
    pub fn with_loras(mut self, loras: Vec<LoraSpec>) -> Self {
        self.loras = loras;
        self
    }
    /// Tiled VAE decoding and encoding (default: [`VaeTiling::Auto`]).
    pub fn with_vae_tiling(mut self, tiling: VaeTiling) -> Self {
        self.vae_tiling = tiling;
        self
    }
    /// The side of the VAE's tiles in pixels, a multiple of 64 (default: the bundle's
    /// `vae.sample_size`, 1024 for FLUX.2), as diffusers' `vae.tile_sample_min_size` (with
    /// `tile_latent_min_size` a VAE scale factor smaller). Smaller tiles hold less memory and
    /// overlap more; it applies where [`VaeTiling`] tiles (`Auto` still tiles only above
    /// [`AUTO_TILING_PIXELS`]).
    pub fn with_vae_tile_size(mut self, pixels: u32) -> Self {
        self.vae_tile_size = Some(pixels);
        self
    }
    /// Runs the graphs on `device` (default: [`Device::Auto`]).
    pub fn with_device(mut self, device: Device) -> Self {
        self.session = self.session.with_device(device);
        self
    }
    /// Uses `threads` threads inside one operator (default: ONNX Runtime's choice).
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.session = self.session.with_intra_threads(threads);
        self
    }
    /// CUDA provider settings (with a CUDA device, or auto).
    pub fn with_cuda(mut self, cuda: CudaOptions) -> Self {
        self.session = self.session.with_cuda(cuda);
        self
    }
    /// CoreML provider settings (with the CoreML device, or auto).
    pub fn with_coreml(mut self, coreml: CoreMlOptions) -> Self {
        self.session = self.session.with_coreml(coreml);
        self
    }
    /// Keeps CPU sessions' optimised graphs, with their prepacked weights, in `dir` between
    /// processes (created if missing); see [`SessionConfig::with_cpu_cache_dir`].
    pub fn with_cpu_cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.session = self.session.with_cpu_cache_dir(dir);
        self
    }
    /// Most GiB the CPU cache's entries may take; see [`SessionConfig::with_cpu_cache_limit_gib`].
    pub fn with_cpu_cache_limit_gib(mut self, gib: u64) -> Self {
        self.session = self.session.with_cpu_cache_limit_gib(gib);
        self
    }
    /// Every session setting at once.
    pub fn with_session(mut self, session: SessionConfig) -> Self {
        self.session = session;
        self
    }
    /// Where the ONNX Runtime library comes from.
    pub fn with_runtime(mut self, runtime: RuntimeOptions) -> Self {
        self.runtime = runtime;
        self
    }
    /// Keeps the text-encoder session loaded after encoding (default: released).
    pub fn with_keep_text_encoder(mut self, keep: bool) -> Self {
        self.keep_text_encoder = keep;
        self
    }
    /// Releases the transformer session once [`crate::pipeline::Pipeline::generate`] has denoised
    /// its last image, before the decode (default: kept loaded). The VAE decoder then reuses the
    /// transformer's weights' memory, so the run's peak is the larger of the two stages, not
    /// their sum; the next `generate` loads the transformer again. For one image per process
    /// (the CLI's `klein generate`) or a server short of memory.
    pub fn with_release_transformer(mut self, release: bool) -> Self {
        self.release_transformer = release;
        self
    }
    /// Checks the sha256 of every bundle file against the manifest before loading any graph
    /// (default: on). A stamp in the cache directory skips the hashing while no file changes
    /// ([`crate::bundle::Manifest::verify_hashes_cached`]).
    pub fn with_verify_hashes(mut self, verify: bool) -> Self {
        self.verify_hashes = verify;
        self
    }
    /// Directory for verification stamps (default: [`crate::bundle::default_cache_dir`]).
    pub fn with_cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cache_dir = Some(dir.into());
        self
    }
    /// Keeps prompt embeddings on disk in `dir`, keyed by the bundle and the prompt. `dir` is
    /// created when the pipeline loads (an error if it cannot be); an entry that cannot be written
    /// later is a warning. Past the limit ([`Self::with_prompt_cache_limit_mib`]), the least
    /// recently used entries are removed.
    pub fn with_prompt_cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.prompt_cache_dir = Some(dir.into());
        self
    }
    /// Most MiB the prompt cache directory's entries may take together, those of other bundles
    /// included (default [`super::DEFAULT_PROMPT_CACHE_MIB`]; 1 to
    /// [`crate::limits::MAX_PROMPT_CACHE_MIB`]); refused without [`Self::with_prompt_cache_dir`].
    pub fn with_prompt_cache_limit_mib(mut self, mib: u64) -> Self {
        self.prompt_cache_mib = Some(mib);
        self
    }
}
