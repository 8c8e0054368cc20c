//! The C API: [`Pipeline`] for C, C++, Swift and anything else with a C FFI.
//!
//! The crate builds as `libklein.so` / `libklein.dylib` / `klein.dll` (cdylib) and `libklein.a`
//! (staticlib); `build.rs` generates the header from this module (`src/capi/`) with cbindgen into
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

mod convert;
mod types;

use std::ffi::{c_char, c_void, CString};
use std::ops::ControlFlow;
use std::panic::{self, AssertUnwindSafe};
use std::path::Path;
use std::ptr;
use std::slice;

use crate::error::KleinError;
use crate::limits::MAX_LORAS;
use crate::pipeline::{LoraSpec, Pipeline, PipelineOptions, Progress};

use convert::*;
use types::KleinStatus::*;
pub use types::*;

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
