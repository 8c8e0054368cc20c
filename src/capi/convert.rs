//! What every entry point of the C API shares: the panic guard and its failures, C strings in and
//! out, and the conversion of `KleinOptions` and `KleinRequest` into the library's options and
//! request.
use std::any::Any;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{self, AssertUnwindSafe};
use std::path::Path;
use std::ptr;
use std::slice;

use crate::error::KleinError;
use crate::limits::MAX_SIDE;
use crate::pipeline::request::check_reference_count;
use crate::pipeline::{Inpaint, Pipeline, PipelineOptions, Request, VaeTiling};
use crate::runtime::{CoreMlOptions, CudaOptions, RuntimeOptions};
use crate::stages::inpaint::{check_strength, DEFAULT_STRENGTH};

use super::types::KleinStatus::*;
use super::types::*;

/// Why a call failed: its status and message.
#[derive(Debug)]
pub(super) struct Failure {
    pub(super) status: KleinStatus,
    pub(super) message: String,
}

impl Failure {
    pub(super) fn invalid(message: impl Into<String>) -> Failure {
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
pub(super) unsafe fn guard(
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
pub(super) fn c_string(text: String) -> *mut c_char {
    // Interior NULs would cut the text short; CString::new cannot fail without them.
    CString::new(text.replace('\0', "\u{FFFD}"))
        .unwrap_or_default()
        .into_raw()
}

pub(super) fn panic_message(payload: &(dyn Any + Send)) -> &str {
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
pub(super) unsafe fn required_str<'a>(ptr: *const c_char, what: &str) -> Result<&'a str, Failure> {
    // SAFETY: the caller's guarantee.
    unsafe { optional_str(ptr, what) }?.ok_or_else(|| Failure::invalid(format!("{what} is NULL")))
}

/// A C string argument that may be NULL.
///
/// # Safety
/// As [`required_str`].
pub(super) unsafe fn optional_str<'a>(
    ptr: *const c_char,
    what: &str,
) -> Result<Option<&'a str>, Failure> {
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
pub(super) unsafe fn pipeline_options(options: &KleinOptions) -> Result<PipelineOptions, Failure> {
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
pub(super) unsafe fn to_request(
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
pub(super) unsafe fn request_preview(
    request: *const KleinRequest,
) -> (KleinPreviewFn, *mut c_void) {
    // SAFETY: the caller's guarantee.
    match unsafe { request.as_ref() } {
        Some(r) if r.preview_every != 0 => (r.preview, r.preview_user_data),
        _ => (None, ptr::null_mut()),
    }
}

/// Bytes of `count` `width x height` RGBA images (at most 16 x 4096 x 4096 x 4: no overflow).
pub(super) fn rgba_len_for(width: u32, height: u32, count: usize) -> usize {
    width as usize * height as usize * 4 * count
}

/// A step count for C (`u32`); counts are far below `u32::MAX`.
pub(super) fn saturate(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::super::klein_string_free;
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
