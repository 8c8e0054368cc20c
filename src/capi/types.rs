//! The C API's types: the status codes, the options and request structs (zero-initialised in C:
//! 0 and NULL mean the default), the callbacks, and the opaque pipeline.
use std::ffi::{c_char, c_void};

use crate::pipeline::Pipeline;

/// The result of every call.
#[repr(i32)]
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KleinStatus {
    /// Success.
    KLEIN_OK = 0,
    /// A NULL pointer where a value is required, or a string that is not UTF-8.
    KLEIN_ERROR_INVALID_ARGUMENT = 1,
    /// Something the caller gave cannot be used: bundle, image file, size, steps, device, ONNX
    /// Runtime library. The message says what would be valid.
    KLEIN_ERROR_USER = 2,
    /// A graph failed to load or run, or the machine refused what a file needs (a full disk or
    /// quota, memory).
    KLEIN_ERROR_RUNTIME = 3,
    /// The progress callback returned non-zero.
    KLEIN_CANCELLED = 4,
    /// A bug in klein (a Rust panic); the message is the panic's. Free the pipeline involved:
    /// its state is unknown.
    KLEIN_ERROR_PANIC = 5,
    /// `rgba_len` is less than `num_images * width * height * 4`; `*out_width` and `*out_height`
    /// hold the size of one image.
    KLEIN_ERROR_BUFFER_TOO_SMALL = 6,
}

/// How to load a bundle. Zero-initialise, then set what you need.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KleinOptions {
    /// `"cpu"`, `"cuda"`, `"cuda:N"`, `"coreml"` or `"auto"`; NULL: `"auto"`.
    pub device: *const c_char,
    /// Threads inside one operator; 0: ONNX Runtime's default.
    pub threads: u32,
    /// Path of the ONNX Runtime shared library; NULL: `ORT_DYLIB_PATH`, then the path baked in at
    /// build time (`KLEIN_ORT_DYLIB`), then next to the executable, then `.ort/` two folders above
    /// the executable's (`<repo>/target/release/app` finds `<repo>/.ort/`, where
    /// `scripts/setup-ort.sh` installs it). An app outside the repository should pass it.
    pub ort_library: *const c_char,
    /// CoreML: `"all"`, `"cpu-gpu"`, `"cpu-ane"` (Neural Engine) or `"cpu"`; NULL: `"all"`.
    pub coreml_units: *const c_char,
    /// CoreML: directory where compiled models are kept between runs (created if missing); NULL:
    /// compile at every load. An app should pass a directory of its own caches.
    pub coreml_cache_dir: *const c_char,
    /// CUDA: largest size of ONNX Runtime's GPU memory arena in bytes; 0: no limit.
    pub cuda_memory_limit: u64,
    /// Tiled VAE decoding and encoding: `"auto"` (images over 1024x1024 pixels), `"on"` (as
    /// diffusers' `vae.enable_tiling()`) or `"off"`; NULL: `"auto"`.
    pub vae_tiling: *const c_char,
    /// CPU: directory where each graph is kept as ONNX Runtime optimised it, with its prepacked
    /// weights (created if missing; about the bundle's size again on disk): the first load writes
    /// it, later loads map it instead of prepacking again. NULL: prepack at every load.
    pub cpu_cache_dir: *const c_char,
    /// The side of the VAE's tiles in pixels, a multiple of 64 (`PipelineOptions::with_vae_tile_size`);
    /// 0: the bundle's. It applies where `vae_tiling` tiles.
    pub vae_tile_size: u32,
    /// Release the transformer before each generation's decode, and load it again on the next
    /// (`PipelineOptions::with_release_transformer`): the peak is then the larger of denoising and
    /// decoding, not their sum. For one image per process or little memory; false: kept.
    pub release_transformer: bool,
    /// Directory where prompt embeddings are kept between calls and processes (created if
    /// missing; one file per prompt and bundle, 15.7 MB for the 4B): a prompt seen before skips
    /// the text encoder. NULL: no prompt cache.
    pub prompt_cache_dir: *const c_char,
    /// Most MiB the prompt cache's entries may take (the least recently used are removed past
    /// it); 0: 4096.
    pub prompt_cache_max_mib: u64,
    /// Most GiB the CPU cache's entries may take (the least recently used are removed when a
    /// graph is saved past it); 0: no limit.
    pub cpu_cache_max_gib: u64,
}

/// What to generate: `num_images` images of one prompt. Zero-initialise, then set what you need.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KleinRequest {
    /// The prompt (required).
    pub prompt: *const c_char,
    /// Seed of the initial noise (as `torch.Generator("cpu").manual_seed(seed)`).
    pub seed: u64,
    /// Output size in pixels, floored to a multiple of 16; 0: the first reference's size, else the
    /// bundle's default.
    pub width: u32,
    pub height: u32,
    /// Denoising steps; 0: the bundle's default.
    pub steps: u32,
    /// Classifier-free guidance scale (base models only); 0: the bundle's default. A value of 1 or
    /// less turns guidance off, as in diffusers.
    pub guidance: f64,
    /// Images to generate for the prompt, written one after the other into `rgba_out`; 0: 1.
    pub num_images: u32,
    /// `reference_count` paths of reference images (PNG, JPEG, WebP); may be NULL when the count is 0.
    pub reference_paths: *const *const c_char,
    pub reference_count: usize,
    /// What guidance steers away from (base models with guidance above 1); NULL: the empty
    /// prompt, as diffusers. Refused (`KLEIN_ERROR_USER`) on distilled models.
    pub negative_prompt: *const c_char,
    /// Inpainting and img2img: the source image (PNG, JPEG, WebP); the output has its size
    /// floored to multiples of 16 (80x72 gives 80x64), and `width`/`height` must be 0 or give
    /// that size once floored. NULL: generate from noise.
    pub image_path: *const c_char,
    /// The inpainting mask for `image_path` (white repaints, black keeps; any size); NULL with an
    /// image: img2img, everything repainted.
    pub mask_path: *const c_char,
    /// With an image: above 0 to 1, the share of the steps that run; 0: klein's default, 1.0.
    pub strength: f64,
    /// Step previews: `preview` is called every `preview_every` steps (and after the last) for
    /// each image; 0 or a NULL `preview`: none. Refused (`KLEIN_ERROR_USER`) for a bundle without
    /// a preview map.
    pub preview_every: u32,
    pub preview: KleinPreviewFn,
    pub preview_user_data: *mut c_void,
    /// Inpainting with `mask_path`: non-zero crops to the mask's region, as diffusers'
    /// `padding_mask_crop` (`Pipeline::crop_to_mask`), with `mask_crop_padding` (0 to 4096) pixels
    /// of context; the output then has the source image's size (not floored to 16). 0: the whole
    /// source.
    pub mask_crop: u8,
    pub mask_crop_padding: u32,
}

/// Called with a step preview of image `image` (0-based in the batch) after step `step` of
/// `total`: `width * height * 3` RGB bytes, row-major, valid during the call only (1/8 of the
/// output's side; the model's current estimate of the image). Return 0 to go on, non-zero to
/// cancel, as the progress callback. It must not unwind out of the call.
pub type KleinPreviewFn = Option<
    unsafe extern "C" fn(
        user_data: *mut c_void,
        step: u32,
        total: u32,
        image: u32,
        rgb: *const u8,
        width: u32,
        height: u32,
    ) -> i32,
>;

/// Called after each denoising step `step` (1-based) of `total`, on the thread that called
/// `klein_generate`. Return 0 to go on, non-zero to cancel: the call then returns
/// `KLEIN_CANCELLED`. It must not unwind (no C++ exception, no `longjmp`) out of the call.
pub type KleinProgressFn =
    Option<unsafe extern "C" fn(user_data: *mut c_void, step: u32, total: u32) -> i32>;

/// A loaded bundle (opaque). Create with `klein_pipeline_load`, release with `klein_pipeline_free`.
pub struct KleinPipeline {
    pub(super) pipeline: Pipeline,
    /// Warnings of `klein_generate` that the library reports as facts of a generation (a
    /// truncated prompt), kept for `klein_take_warnings`.
    pub(super) notes: Vec<String>,
}
