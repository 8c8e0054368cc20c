//! The C API: [`Pipeline`] for C, C++, Swift and anything else with a C FFI.
//!
//! The crate builds as `libklein.so` / `libklein.dylib` / `klein.dll` (cdylib) and `libklein.a`
//! (staticlib); `build.rs` generates the header from this file with cbindgen into
//! `target/<profile>/include/klein.h`. `examples/c/generate.c` is a complete program. This is the
//! only module with `unsafe` code and `extern "C"` functions.
//!
//! # Conventions
//! - Every function but [`klein_pipeline_free`] and [`klein_string_free`] returns a [`KleinStatus`]
//!   (an `int32_t` in C): `KLEIN_OK` (0) or an error code.
//! - `error_message` may be NULL. Otherwise every call sets `*error_message`: NULL on success, or a
//!   NUL-terminated UTF-8 message that the caller owns and releases with [`klein_string_free`]
//!   (not `free`: the memory belongs to Rust's allocator).
//! - Strings are NUL-terminated UTF-8. NULL where a value is required, or invalid UTF-8, is
//!   `KLEIN_ERROR_INVALID_ARGUMENT`.
//! - Zero-initialise [`KleinOptions`] and [`KleinRequest`] (`KleinRequest req = {0};`): 0 and NULL
//!   mean "the default".
//! - No panic crosses the boundary: every entry point catches one and returns `KLEIN_ERROR_PANIC`
//!   with the panic's message (this needs the default `panic = "unwind"` profile setting).
//!
//! # Threads
//! A [`KleinPipeline`] may be used from any thread, but by one thread at a time: calls on the same
//! pipeline must not overlap (put a mutex around a shared one). Separate pipelines run in
//! parallel. The ONNX Runtime library is loaded once per process, by the first successful
//! [`klein_pipeline_load`]; later loads must name the same library or none.
#![allow(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]

use std::any::Any;
use std::ffi::{c_char, c_void, CStr, CString};
use std::ops::ControlFlow;
use std::panic::{self, AssertUnwindSafe};
use std::path::Path;
use std::ptr;
use std::slice;

use crate::error::KleinError;
use crate::limits::{MAX_LORAS, MAX_SIDE};
use crate::pipeline::request::check_reference_count;
use crate::pipeline::{Inpaint, LoraSpec, Pipeline, PipelineOptions, Progress, Request, VaeTiling};
use crate::runtime::{CoreMlOptions, CudaOptions, RuntimeOptions};
use crate::stages::inpaint::{check_strength, DEFAULT_STRENGTH};

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

use KleinStatus::*;

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
    pipeline: Pipeline,
    /// Warnings of `klein_generate` that the library reports as facts of a generation (a
    /// truncated prompt), kept for `klein_take_warnings`.
    notes: Vec<String>,
}

/// Opens the bundle directory `bundle_dir` (see `onnx/README.md`) and stores a new pipeline in
/// `*out` (NULL on failure). The bundle's files are checked against the sha256 in its manifest
/// (`KLEIN_ERROR_USER` if one differs), unless a verification stamp in `$KLEIN_CACHE_DIR` (else
/// `$XDG_CACHE_HOME/klein`, else `~/.cache/klein`) shows them unchanged since the last check.
/// Graphs are loaded on first use.
///
/// `options` may be NULL (all defaults). The pipeline is owned by the caller and released with
/// `klein_pipeline_free`; the strings given are only read during the call. Thread-safe: may be
/// called from several threads at once.
///
/// # Safety
/// `bundle_dir` and the strings of `options` are NULL or NUL-terminated; `options` is NULL or
/// points to a `KleinOptions`; `out` is NULL or writable; `error_message` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn klein_pipeline_load(
    bundle_dir: *const c_char,
    options: *const KleinOptions,
    out: *mut *mut KleinPipeline,
    error_message: *mut *mut c_char,
) -> KleinStatus {
    let body = || {
        // SAFETY (each block): the pointer guarantees in `# Safety` above.
        let out = unsafe { out.as_mut() }.ok_or_else(|| Failure::invalid("out is NULL"))?;
        *out = ptr::null_mut();
        let dir = unsafe { required_str(bundle_dir, "bundle_dir") }?;
        let options = match unsafe { options.as_ref() } {
            Some(options) => unsafe { pipeline_options(options) }?,
            None => PipelineOptions::default(),
        };
        let pipeline = Pipeline::load(Path::new(dir), options)?;
        *out = Box::into_raw(Box::new(KleinPipeline {
            pipeline,
            notes: Vec::new(),
        }));
        Ok(())
    };
    // SAFETY: `error_message` is NULL or writable.
    unsafe { guard(error_message, body) }
}

/// The size in pixels of the image `klein_generate` would make for `request`, so that the caller
/// can allocate `width * height * 4` bytes first. Reads the reference images when the size comes
/// from the first one.
///
/// Thread-safety: reads the pipeline only, but must not overlap a `klein_generate` on the same
/// pipeline.
///
/// # Safety
/// `pipeline` is NULL or from `klein_pipeline_load` and not freed; `request` is NULL or points to
/// a `KleinRequest` whose strings are NUL-terminated and whose `reference_paths` holds
/// `reference_count` pointers; `out_width`, `out_height`, `error_message` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn klein_output_size(
    pipeline: *const KleinPipeline,
    request: *const KleinRequest,
    out_width: *mut u32,
    out_height: *mut u32,
    error_message: *mut *mut c_char,
) -> KleinStatus {
    let body = || {
        // SAFETY (each block): the pointer guarantees in `# Safety` above.
        let pipeline = &unsafe { pipeline.as_ref() }
            .ok_or_else(|| Failure::invalid("pipeline is NULL"))?
            .pipeline;
        let out_width =
            unsafe { out_width.as_mut() }.ok_or_else(|| Failure::invalid("out_width is NULL"))?;
        let out_height =
            unsafe { out_height.as_mut() }.ok_or_else(|| Failure::invalid("out_height is NULL"))?;
        let request = unsafe { to_request(pipeline, request) }?;
        (*out_width, *out_height) = pipeline.output_size(&request)?;
        Ok(())
    };
    // SAFETY: `error_message` is NULL or writable.
    unsafe { guard(error_message, body) }
}

/// Generates `request.num_images` images (0 or 1: one) into the caller's buffer `rgba_out`:
/// `num_images * width * height * 4` bytes, the images one after the other, each row-major
/// `[height, width, 4]` RGBA with alpha 255. The buffer is written only on `KLEIN_OK`.
///
/// `out_width` and `out_height` (each may be NULL) receive the image size as soon as it is known,
/// also with `KLEIN_ERROR_BUFFER_TOO_SMALL`, which is returned before any work when `rgba_len` is
/// short. `progress` (may be NULL) is called with `user_data` after every denoising step and
/// cancels with a non-zero return: `KLEIN_CANCELLED`; the pipeline stays usable.
///
/// Thread-safety: one call at a time per pipeline; separate pipelines may generate in parallel.
///
/// # Safety
/// As `klein_output_size`, and: `pipeline` is not used by another thread during the call;
/// `rgba_out` is NULL or points to `rgba_len` writable bytes; `progress` is NULL or a function
/// that may be called with `user_data`.
#[no_mangle]
#[allow(clippy::too_many_arguments)] // the C signature: buffer, its length, size, callback and message
pub unsafe extern "C" fn klein_generate(
    pipeline: *mut KleinPipeline,
    request: *const KleinRequest,
    rgba_out: *mut u8,
    rgba_len: usize,
    out_width: *mut u32,
    out_height: *mut u32,
    progress: KleinProgressFn,
    user_data: *mut c_void,
    error_message: *mut *mut c_char,
) -> KleinStatus {
    let body = || {
        // SAFETY (each block): the pointer guarantees in `# Safety` above.
        let KleinPipeline { pipeline, notes } =
            unsafe { pipeline.as_mut() }.ok_or_else(|| Failure::invalid("pipeline is NULL"))?;
        let request_ptr = request;
        let request = unsafe { to_request(pipeline, request) }?;
        let (width, height) = pipeline.output_size(&request)?;
        if let Some(out) = unsafe { out_width.as_mut() } {
            *out = width;
        }
        if let Some(out) = unsafe { out_height.as_mut() } {
            *out = height;
        }
        let count = request.num_images;
        let needed = rgba_len_for(width, height, count);
        if rgba_len < needed {
            return Err(Failure {
                status: KLEIN_ERROR_BUFFER_TOO_SMALL,
                message: format!(
                    "rgba_out holds {rgba_len} bytes; {count} {width}x{height} image(s) need {needed} \
                     (num_images * width * height * 4)"
                ),
            });
        }
        if rgba_out.is_null() {
            return Err(Failure::invalid("rgba_out is NULL"));
        }

        // SAFETY: the caller's guarantee (read again for the preview callback).
        let (preview, preview_data) = unsafe { request_preview(request_ptr) };
        let mut on_progress = |event: Progress| match (progress, preview, event) {
            (Some(callback), _, Progress::Step { step, total }) => {
                match unsafe { callback(user_data, saturate(step), saturate(total)) } {
                    0 => ControlFlow::Continue(()),
                    _ => ControlFlow::Break(()),
                }
            }
            (_, Some(callback), Progress::Preview(p)) => {
                for (i, image) in p.images.iter().enumerate() {
                    // SAFETY: the caller's guarantee; the pixels outlive the call.
                    let answer = unsafe {
                        callback(
                            preview_data,
                            saturate(p.step),
                            saturate(p.total),
                            saturate(p.first_image + i),
                            image.pixels.as_ptr(),
                            image.width,
                            image.height,
                        )
                    };
                    if answer != 0 {
                        return ControlFlow::Break(());
                    }
                }
                ControlFlow::Continue(())
            }
            _ => ControlFlow::Continue(()),
        };
        let generation = pipeline.generate(&request, Some(&mut on_progress))?;
        let truncated = format!(
            "the prompt is longer than {} tokens and was truncated, as the reference pipeline does",
            pipeline.manifest().tokenizer.max_sequence_length
        );
        // Once until taken: an app that never takes them keeps one line, not one per image.
        if generation.prompt_truncated && !notes.contains(&truncated) {
            notes.push(truncated);
        }
        let images = &generation.images;
        if images.len() != count
            || images
                .iter()
                .any(|i| (i.width, i.height) != (width, height))
        {
            return Err(Failure {
                status: KLEIN_ERROR_RUNTIME,
                message: format!(
                    "expected {count} {width}x{height} image(s), the pipeline made {:?}",
                    images
                        .iter()
                        .map(|i| (i.width, i.height))
                        .collect::<Vec<_>>()
                ),
            });
        }
        // Non-NULL with at least `needed` bytes (checked above).
        let rgba = unsafe { slice::from_raw_parts_mut(rgba_out, needed) };
        // N x [H, W, 3] -> [N, H, W, 4], alpha 255
        let pixels = images.iter().flat_map(|i| i.pixels.chunks_exact(3));
        for (dst, src) in rgba.chunks_exact_mut(4).zip(pixels) {
            dst[..3].copy_from_slice(src);
            dst[3] = u8::MAX;
        }
        Ok(())
    };
    // SAFETY: `error_message` is NULL or writable.
    unsafe { guard(error_message, body) }
}

/// Applies `count` LoRAs (`paths[i]` with `scales[i]`; `count` 0: none) to the pipeline's
/// transformer from the next generation on, in place of those applied before. Each file is read
/// and checked now: a LoRA for another model or size, keys that match no layer, or a quantized or
/// static-shape bundle give `KLEIN_ERROR_USER` with the reason, and the pipeline keeps its LoRAs.
/// Only the transformer is reloaded when the LoRAs change.
///
/// Thread-safety: as `klein_generate`.
///
/// # Safety
/// `pipeline` is NULL or from `klein_pipeline_load` and not freed, and not used by another thread
/// during the call; `paths` and `scales` hold `count` elements (may be NULL when `count` is 0),
/// each path NUL-terminated; `error_message` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn klein_set_loras(
    pipeline: *mut KleinPipeline,
    paths: *const *const c_char,
    scales: *const f32,
    count: usize,
    error_message: *mut *mut c_char,
) -> KleinStatus {
    let body = || {
        // SAFETY (each block): the pointer guarantees in `# Safety` above.
        let pipeline = &mut unsafe { pipeline.as_mut() }
            .ok_or_else(|| Failure::invalid("pipeline is NULL"))?
            .pipeline;
        if count > MAX_LORAS {
            return Err(Failure::from(KleinError::request(format!(
                "{count} LoRAs; at most {MAX_LORAS} can be applied at once"
            ))));
        }
        let mut loras = Vec::with_capacity(count);
        if count > 0 {
            if paths.is_null() || scales.is_null() {
                return Err(Failure::invalid(
                    "paths or scales is NULL with a non-zero count",
                ));
            }
            let paths = unsafe { slice::from_raw_parts(paths, count) };
            let scales = unsafe { slice::from_raw_parts(scales, count) };
            for (i, (&path, &scale)) in paths.iter().zip(scales).enumerate() {
                let path = unsafe { required_str(path, &format!("paths[{i}]")) }?;
                loras.push(LoraSpec::new(path, scale));
            }
        }
        pipeline.set_loras(&loras)?;
        Ok(())
    };
    // SAFETY: `error_message` is NULL or writable.
    unsafe { guard(error_message, body) }
}

/// Moves the pipeline's warnings since the last call into `*warnings`: one per line, or NULL when
/// there are none (`guidance` on a distilled model, which changed nothing; a prompt longer than
/// the text encoder reads; a CPU cache that could not be used...). The text is the caller's, to
/// release with `klein_string_free`; the pipeline's list is then empty. Call it after
/// `klein_generate` (and `klein_pipeline_load`, `klein_set_loras`) to show what the CLI prints.
///
/// Thread-safety: as `klein_generate`.
///
/// # Safety
/// `pipeline` is NULL or from `klein_pipeline_load` and not freed, and not used by another thread
/// during the call; `warnings` and `error_message` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn klein_take_warnings(
    pipeline: *mut KleinPipeline,
    warnings: *mut *mut c_char,
    error_message: *mut *mut c_char,
) -> KleinStatus {
    let body = || {
        // SAFETY (each block): the pointer guarantees in `# Safety` above.
        let slot =
            unsafe { warnings.as_mut() }.ok_or_else(|| Failure::invalid("warnings is NULL"))?;
        *slot = ptr::null_mut();
        let KleinPipeline { pipeline, notes } =
            unsafe { pipeline.as_mut() }.ok_or_else(|| Failure::invalid("pipeline is NULL"))?;
        let mut taken = pipeline.take_warnings();
        taken.append(notes);
        if !taken.is_empty() {
            *slot = c_string(taken.join("\n"));
        }
        Ok(())
    };
    // SAFETY: `error_message` is NULL or writable.
    unsafe { guard(error_message, body) }
}

/// Releases a pipeline and every ONNX Runtime session it holds. NULL is a no-op. The pointer must
/// not be used afterwards, nor while another thread uses it.
///
/// # Safety
/// `pipeline` is NULL or from `klein_pipeline_load` and not yet freed.
#[no_mangle]
pub unsafe extern "C" fn klein_pipeline_free(pipeline: *mut KleinPipeline) {
    if pipeline.is_null() {
        return;
    }
    // SAFETY: the pointer came from `Box::into_raw` in `klein_pipeline_load` and is freed once.
    let pipeline = unsafe { Box::from_raw(pipeline) };
    // A panic while dropping cannot be reported (no status): it is swallowed, not propagated.
    let _ = panic::catch_unwind(AssertUnwindSafe(move || drop(pipeline)));
}

/// Releases a message returned through `error_message` (or the text of `klein_take_warnings`).
/// NULL is a no-op. Thread-safe.
///
/// # Safety
/// `message` is NULL or a message from this library not yet freed.
#[no_mangle]
pub unsafe extern "C" fn klein_string_free(message: *mut c_char) {
    if !message.is_null() {
        // SAFETY: the message came from `CString::into_raw` in `guard` and is freed once.
        drop(unsafe { CString::from_raw(message) });
    }
}

/// Why a call failed: its status and message.
#[derive(Debug)]
struct Failure {
    status: KleinStatus,
    message: String,
}

impl Failure {
    fn invalid(message: impl Into<String>) -> Failure {
        Failure {
            status: KLEIN_ERROR_INVALID_ARGUMENT,
            message: message.into(),
        }
    }
}

impl From<KleinError> for Failure {
    fn from(error: KleinError) -> Failure {
        let status = match &error {
            KleinError::Cancelled => KLEIN_CANCELLED,
            e if e.is_user_error() => KLEIN_ERROR_USER,
            _ => KLEIN_ERROR_RUNTIME,
        };
        // The whole chain: `Io` errors keep the OS error as their source.
        let mut message = error.to_string();
        let mut source = std::error::Error::source(&error);
        while let Some(cause) = source {
            message.push_str(": ");
            message.push_str(&cause.to_string());
            source = cause.source();
        }
        Failure { status, message }
    }
}

/// Runs the body of an entry point: a panic becomes `KLEIN_ERROR_PANIC`; the failure's message (or
/// NULL on success) goes to `*error_message` when that is not NULL.
///
/// # Safety
/// `error_message` is NULL or writable.
unsafe fn guard(
    error_message: *mut *mut c_char,
    body: impl FnOnce() -> Result<(), Failure>,
) -> KleinStatus {
    let outcome = panic::catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|payload| {
        Err(Failure {
            status: KLEIN_ERROR_PANIC,
            message: format!("klein panicked: {}", panic_message(&*payload)),
        })
    });
    let (status, message) = match outcome {
        Ok(()) => (KLEIN_OK, None),
        Err(Failure { status, message }) => (status, Some(message)),
    };
    // SAFETY: the caller's guarantee.
    if let Some(slot) = unsafe { error_message.as_mut() } {
        *slot = message.map_or(ptr::null_mut(), c_string);
    }
    status
}

/// `text` as a C string the caller releases with [`klein_string_free`].
fn c_string(text: String) -> *mut c_char {
    // Interior NULs would cut the text short; CString::new cannot fail without them.
    CString::new(text.replace('\0', "\u{FFFD}"))
        .unwrap_or_default()
        .into_raw()
}

fn panic_message(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(a panic without a message)")
}

/// A C string argument that must be present.
///
/// # Safety
/// `ptr` is NULL or NUL-terminated and outlives `'a`.
unsafe fn required_str<'a>(ptr: *const c_char, what: &str) -> Result<&'a str, Failure> {
    // SAFETY: the caller's guarantee.
    unsafe { optional_str(ptr, what) }?.ok_or_else(|| Failure::invalid(format!("{what} is NULL")))
}

/// A C string argument that may be NULL.
///
/// # Safety
/// As [`required_str`].
unsafe fn optional_str<'a>(ptr: *const c_char, what: &str) -> Result<Option<&'a str>, Failure> {
    if ptr.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL and NUL-terminated (the caller's guarantee).
    let bytes = unsafe { CStr::from_ptr(ptr) };
    bytes
        .to_str()
        .map(Some)
        .map_err(|e| Failure::invalid(format!("{what} is not UTF-8: {e}")))
}

/// # Safety
/// The strings of `options` are NULL or NUL-terminated.
unsafe fn pipeline_options(options: &KleinOptions) -> Result<PipelineOptions, Failure> {
    let KleinOptions {
        device,
        threads,
        ort_library,
        coreml_units,
        coreml_cache_dir,
        cuda_memory_limit,
        vae_tiling,
        cpu_cache_dir,
        vae_tile_size,
        release_transformer,
        prompt_cache_dir,
        prompt_cache_max_mib,
        cpu_cache_max_gib,
    } = *options;
    let mut result = PipelineOptions::default().with_release_transformer(release_transformer);
    // SAFETY: the caller's guarantee.
    if let Some(device) = unsafe { optional_str(device, "options.device") }? {
        result = result.with_device(device.parse()?);
    }
    if threads > 0 {
        result = result.with_threads(threads as usize);
    }
    // SAFETY: the caller's guarantee.
    if let Some(tiling) = unsafe { optional_str(vae_tiling, "options.vae_tiling") }? {
        let tiling = tiling
            .parse::<VaeTiling>()
            .map_err(|e| KleinError::request(format!("options.vae_tiling {e}")))?;
        result = result.with_vae_tiling(tiling);
    }
    if vae_tile_size != 0 {
        result = result.with_vae_tile_size(vae_tile_size);
    }
    // SAFETY: the caller's guarantee.
    if let Some(library) = unsafe { optional_str(ort_library, "options.ort_library") }? {
        result = result.with_runtime(RuntimeOptions::default().with_library(library));
    }
    // SAFETY: the caller's guarantee.
    if let Some(dir) = unsafe { optional_str(cpu_cache_dir, "options.cpu_cache_dir") }? {
        result = result.with_cpu_cache_dir(dir);
    }
    // SAFETY: the caller's guarantee.
    if let Some(dir) = unsafe { optional_str(prompt_cache_dir, "options.prompt_cache_dir") }? {
        result = result.with_prompt_cache_dir(dir);
    }
    if prompt_cache_max_mib > 0 {
        result = result.with_prompt_cache_limit_mib(prompt_cache_max_mib);
    }
    if cpu_cache_max_gib > 0 {
        result = result.with_cpu_cache_limit_gib(cpu_cache_max_gib);
    }
    let mut coreml = CoreMlOptions::default();
    // SAFETY: the caller's guarantee.
    if let Some(units) = unsafe { optional_str(coreml_units, "options.coreml_units") }? {
        coreml = coreml.with_compute_units(units.parse()?);
    }
    // SAFETY: the caller's guarantee.
    if let Some(dir) = unsafe { optional_str(coreml_cache_dir, "options.coreml_cache_dir") }? {
        coreml = coreml.with_cache_dir(dir);
    }
    let mut cuda = CudaOptions::default();
    if cuda_memory_limit > 0 {
        cuda = cuda.with_memory_limit(usize::try_from(cuda_memory_limit).unwrap_or(usize::MAX));
    }
    Ok(result.with_coreml(coreml).with_cuda(cuda))
}

/// The [`Request`] for a C request, with its reference images loaded and preprocessed.
///
/// # Safety
/// As the `request` argument of [`klein_output_size`].
unsafe fn to_request(
    pipeline: &Pipeline,
    request: *const KleinRequest,
) -> Result<Request, Failure> {
    // SAFETY: the caller's guarantee.
    let request = unsafe { request.as_ref() }.ok_or_else(|| Failure::invalid("request is NULL"))?;
    let KleinRequest {
        prompt,
        seed,
        width,
        height,
        steps,
        guidance,
        num_images,
        reference_paths,
        reference_count,
        negative_prompt,
        image_path,
        mask_path,
        strength,
        preview_every,
        preview,
        preview_user_data: _,
        mask_crop,
        mask_crop_padding,
    } = *request;
    // SAFETY: the caller's guarantee.
    let prompt = unsafe { required_str(prompt, "request.prompt") }?;
    let mut result = Request::new(prompt).with_seed(seed);
    result.width = (width != 0).then_some(width);
    result.height = (height != 0).then_some(height);
    result.steps = (steps != 0).then_some(steps as usize);
    result.guidance = (guidance != 0.0).then_some(guidance);
    result.num_images = num_images.max(1) as usize;
    result.preview_every =
        (preview_every != 0 && preview.is_some()).then_some(preview_every as usize);
    if !negative_prompt.is_null() {
        // SAFETY: the caller's guarantee.
        let negative = unsafe { required_str(negative_prompt, "request.negative_prompt") }?;
        result.negative_prompt = Some(negative.to_string());
    }
    // Every number before any reference file is read.
    result.check_bounds()?;
    check_reference_count(reference_count)?;
    if strength != 0.0 {
        check_strength(strength)?;
    }
    if mask_crop_padding > MAX_SIDE {
        return Err(KleinError::request(format!(
            "request.mask_crop_padding {mask_crop_padding}: give 0 to {MAX_SIDE} pixels"
        ))
        .into());
    }
    let paths = match (reference_paths.is_null(), reference_count) {
        (_, 0) => &[][..],
        (true, count) => {
            return Err(Failure::invalid(format!(
                "request.reference_paths is NULL but reference_count is {count}"
            )))
        }
        // SAFETY: `reference_count` readable pointers (the caller's guarantee).
        (false, count) => unsafe { slice::from_raw_parts(reference_paths, count) },
    };
    let mut files = Vec::with_capacity(paths.len());
    for (i, &path) in paths.iter().enumerate() {
        // SAFETY: the caller's guarantee.
        let path = unsafe { required_str(path, &format!("request.reference_paths[{i}]")) }?;
        files.push(Path::new(path));
    }
    result.inpaint = if image_path.is_null() {
        if !mask_path.is_null() || strength != 0.0 || mask_crop != 0 {
            return Err(KleinError::request(
                "request.mask_path, request.strength and request.mask_crop need request.image_path",
            )
            .into());
        }
        None
    } else {
        // SAFETY: the caller's guarantee.
        let image = Path::new(unsafe { required_str(image_path, "request.image_path") }?);
        let strength = if strength == 0.0 {
            DEFAULT_STRENGTH
        } else {
            strength
        };
        let mask = if mask_path.is_null() {
            None
        } else {
            // SAFETY: the caller's guarantee.
            Some(Path::new(unsafe {
                required_str(mask_path, "request.mask_path")
            }?))
        };
        match (mask, mask_crop != 0) {
            (Some(mask), true) => {
                Some(pipeline.load_cropped(image, mask, mask_crop_padding, strength)?)
            }
            (None, true) => {
                return Err(KleinError::request(
                    "request.mask_crop needs request.mask_path: it crops to the mask's region",
                )
                .into())
            }
            (mask, false) => {
                let source = pipeline.load_source(image)?;
                let mask = mask.map(|m| pipeline.load_mask(m, &source)).transpose()?;
                Some(Inpaint::new(source, mask, strength))
            }
        }
    };
    let source_size = result
        .inpaint
        .as_ref()
        .map(|i| (i.image.width, i.image.height));
    // From their headers, before any is decoded.
    result.references = pipeline.load_reference_files(
        &files,
        result.width.or(source_size.map(|s| s.0)),
        result.height.or(source_size.map(|s| s.1)),
    )?;
    Ok(result)
}

/// The preview callback of a request and its user data (none for a NULL request).
///
/// # Safety
/// `request` is NULL or points to a readable [`KleinRequest`].
unsafe fn request_preview(request: *const KleinRequest) -> (KleinPreviewFn, *mut c_void) {
    // SAFETY: the caller's guarantee.
    match unsafe { request.as_ref() } {
        Some(r) if r.preview_every != 0 => (r.preview, r.preview_user_data),
        _ => (None, ptr::null_mut()),
    }
}

/// Bytes of `count` `width x height` RGBA images (at most 16 x 4096 x 4096 x 4: no overflow).
fn rgba_len_for(width: u32, height: u32, count: usize) -> usize {
    width as usize * height as usize * 4 * count
}

/// A step count for C (`u32`); counts are far below `u32::MAX`.
fn saturate(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `guard` and returns its status and message (freed).
    fn run_guarded(body: impl FnOnce() -> Result<(), Failure>) -> (KleinStatus, Option<String>) {
        let mut message: *mut c_char = ptr::null_mut();
        // SAFETY: `message` is writable.
        let status = unsafe { guard(&mut message, body) };
        let text = (!message.is_null()).then(|| {
            // SAFETY: a message from `guard`, freed right after.
            let text = unsafe { CStr::from_ptr(message) }
                .to_string_lossy()
                .into_owned();
            unsafe { klein_string_free(message) };
            text
        });
        (status, text)
    }

    #[test]
    fn panic_becomes_status_with_message() {
        let (status, message) = run_guarded(|| panic!("boom {}", 42));
        assert_eq!(status, KLEIN_ERROR_PANIC);
        assert_eq!(message.as_deref(), Some("klein panicked: boom 42"));
    }

    #[test]
    fn errors_map_to_statuses() {
        let cases = [
            (KleinError::Cancelled, KLEIN_CANCELLED),
            (KleinError::request("steps is 0"), KLEIN_ERROR_USER),
            (
                KleinError::Inference {
                    stage: "decode",
                    message: "bad".into(),
                },
                KLEIN_ERROR_RUNTIME,
            ),
        ];
        for (error, want) in cases {
            let text = error.to_string();
            let (status, message) = run_guarded(|| Err(error.into()));
            assert_eq!((status, message.as_deref()), (want, Some(text.as_str())));
        }
        assert_eq!(run_guarded(|| Ok(())), (KLEIN_OK, None));
    }

    #[test]
    fn io_error_message_keeps_its_cause() {
        let error = KleinError::Io {
            path: "/x.png".into(),
            action: "read",
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
        };
        let (status, message) = run_guarded(|| Err(error.into()));
        assert_eq!(
            (status, message.as_deref()),
            (KLEIN_ERROR_USER, Some("/x.png: read failed: no such file"))
        );
    }

    #[test]
    fn interior_nul_does_not_truncate() {
        let (_, message) = run_guarded(|| Err(Failure::invalid("a\0b")));
        assert_eq!(message.as_deref(), Some("a\u{FFFD}b"));
    }
}
