//! What every entry point of the C API shares: the panic guard and its failures, C strings in and
//! out, and the conversion of `KleinOptions` and `KleinRequest` into the library's options and
//! request.
use std::any::Any;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{self, AssertUnwindSafe};
use std::ptr;
use std::slice;

use crate::error::KleinError;
use crate::pipeline::request::check_mask_crop;
use crate::pipeline::{
    ImageInput, Pipeline, PipelineOptions, Request, RequestSpec, Rule, SpecError, VaeTiling,
};
use crate::runtime::{CoreMlOptions, CudaOptions, RuntimeOptions};

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
    let mut spec = RequestSpec::new(prompt);
    spec.seed = Some(seed);
    spec.width = (width != 0).then_some(width);
    spec.height = (height != 0).then_some(height);
    spec.steps = (steps != 0).then_some(steps as usize);
    spec.guidance = (guidance != 0.0).then_some(guidance);
    spec.num_images = num_images.max(1) as usize;
    spec.preview_every =
        (preview_every != 0 && preview.is_some()).then_some(preview_every as usize);
    if !negative_prompt.is_null() {
        // SAFETY: the caller's guarantee.
        let negative = unsafe { required_str(negative_prompt, "request.negative_prompt") }?;
        spec.negative_prompt = Some(negative.to_string());
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
    for (i, &path) in paths.iter().enumerate() {
        // SAFETY: the caller's guarantee.
        let path = unsafe { required_str(path, &format!("request.reference_paths[{i}]")) }?;
        spec.references.push(ImageInput::file(path));
    }
    for (field, path, slot) in [
        ("request.image_path", image_path, &mut spec.source),
        ("request.mask_path", mask_path, &mut spec.mask),
    ] {
        if !path.is_null() {
            // SAFETY: the caller's guarantee.
            *slot = Some(ImageInput::file(unsafe { required_str(path, field) }?));
        }
    }
    spec.strength = (strength != 0.0).then_some(strength);
    spec.mask_crop = (mask_crop != 0).then_some(mask_crop_padding);
    // The padding is refused past its bound whether it is used or not: a C struct's field
    // holds no "unset".
    check_mask_crop(mask_crop_padding).map_err(|e| spec_failure(e.into()))?;
    pipeline.prepare(&spec).map_err(spec_failure)
}

/// A [`SpecError`] in the C API's words: its rules and the crop's padding in `KleinRequest`'s
/// field names.
fn spec_failure(error: SpecError) -> Failure {
    let worded = |message: &str| Failure::from(KleinError::request(message));
    match error.rule {
        Some(Rule::NeedsSource) => worded(
            "request.mask_path, request.strength and request.mask_crop need request.image_path",
        ),
        Some(_) => {
            worded("request.mask_crop needs request.mask_path: it crops to the mask's region")
        }
        None => {
            let mut failure = Failure::from(error.error);
            failure.message =
                failure
                    .message
                    .replacen("padding_mask_crop", "request.mask_crop_padding", 1);
            failure
        }
    }
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
