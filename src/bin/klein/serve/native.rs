//! klein's own routes: `POST /v1/klein/generate` takes every option of `klein generate` and
//! answers with the images and their metadata; `POST /v1/klein/generate/stream` sends the same
//! as server-sent events, with the job's id, its queue position, every stage and step, then the
//! result. `DELETE /v1/klein/jobs/{id}` cancels a queued or running job.
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::Json;
use base64::Engine;
use futures_util::stream::{self, Stream};
use klein::limits::{MAX_LORAS, MAX_REFERENCES};
use klein::pipeline::{ImageInput, RequestSpec};
use klein::stages::output::ImageFormat;
use serde::Deserialize;

use super::error::{ApiError, ErrorKind};
use super::jobs::{JobEvent, JobHandle, JobOutput, JobSpec};
use super::{parse_json, request_id, run_to_end, timed_out, AppState};
use klein::api::{at_most, format_name, image_format, whole, Upload, NATIVE_FORMAT_FIELDS};

/// The body of the native routes: `klein generate`'s options.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NativeBody {
    prompt: String,
    width: Option<u32>,
    height: Option<u32>,
    steps: Option<u64>,
    guidance: Option<f64>,
    seed: Option<u64>,
    num_images: Option<u64>,
    /// Reference images, base64 of PNG, JPEG or WebP files.
    #[serde(default, deserialize_with = "at_most::<_, _, MAX_REFERENCES>")]
    refs: Vec<RefBody>,
    /// Inpainting and img2img: the source image, the mask (white repaints), the strength.
    image: Option<RefBody>,
    mask: Option<RefBody>,
    strength: Option<f64>,
    /// `padding_mask_crop`: inpaint only the mask's region, padded by this many pixels, and paste
    /// it back into the whole source (`klein generate --mask-crop`).
    padding_mask_crop: Option<u32>,
    /// Step previews every this many steps: `preview` events on the stream (1/8-size PNGs).
    preview_every: Option<u64>,
    /// LoRAs offered by the server, `NAME` or `NAME:SCALE`.
    #[serde(default, deserialize_with = "at_most::<_, _, MAX_LORAS>")]
    loras: Vec<String>,
    /// `png` (default), `jpeg` or `webp`.
    format: Option<String>,
    /// JPEG quality, 1 to 100 (default 90); refused with `png` and `webp` (lossless).
    quality: Option<u64>,
    negative_prompt: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RefBody {
    /// Stored in the image's metadata as the reference's name (default `image-N`).
    name: Option<String>,
    /// base64 (standard alphabet, padded) of the file.
    data: String,
}

fn spec_from(state: &AppState, body: NativeBody) -> Result<(JobSpec, ImageFormat), ApiError> {
    let format = image_format(body.format.as_deref(), body.quality, NATIVE_FORMAT_FIELDS)?;
    if body.quality.is_some() && !matches!(format, ImageFormat::Jpeg { .. }) {
        return Err(ApiError::field(
            "quality",
            "quality is for jpeg, and this format is lossless: drop quality or ask for format jpeg",
        ));
    }
    let mut request = RequestSpec::new(body.prompt);
    request.width = body.width;
    request.height = body.height;
    request.steps = body.steps.map(whole);
    request.guidance = body.guidance;
    request.negative_prompt = body.negative_prompt;
    request.seed = body.seed;
    request.num_images = body.num_images.map_or(1, whole);
    request.strength = body.strength;
    request.mask_crop = body.padding_mask_crop;
    request.preview_every = body.preview_every.map(whole);
    request.loras = Some(state.loras.resolve_all(&body.loras)?);
    let mut spec = JobSpec::new(request, ("num_images", "refs"), None, format);
    for (i, r) in body.refs.into_iter().enumerate() {
        spec.add_reference(upload(r, &format!("refs[{i}]"), format!("image-{i}"))?);
    }
    for (field, image, slot) in [
        ("image", body.image, &mut spec.request.source),
        ("mask", body.mask, &mut spec.request.mask),
    ] {
        if let Some(image) = image {
            let upload = upload(image, field, field.into())?;
            *slot = Some(ImageInput::encoded(upload.bytes, upload.label));
        }
    }
    // Every number, rule and image header, before the job is queued.
    spec.check()?;
    Ok((spec, format))
}

/// A base64 file of the body; `field` names it in errors, `default_label` when it has no name.
fn upload(body: RefBody, field: &str, default_label: String) -> Result<Upload, ApiError> {
    let b64 = base64::engine::general_purpose::STANDARD;
    if body.data.starts_with("data:") {
        return Err(ApiError::field(
            &format!("{field}.data"),
            format!(
                "{field}.data is a data URL: give only the base64 text after its comma (the image's \
                 name, if any, goes in {field}.name)"
            ),
        ));
    }
    // Base64 wrapped in lines (MIME's 76 columns) is taken as the same text unwrapped.
    let text: String = body
        .data
        .chars()
        .filter(|c| !c.is_ascii_whitespace())
        .collect();
    let bytes = b64.decode(text).map_err(|e| {
        ApiError::field(
            &format!("{field}.data"),
            format!("{field}.data is not base64: {e}"),
        )
    })?;
    Ok(Upload {
        label: body.name.unwrap_or(default_label),
        bytes,
        field: field.to_string(),
    })
}

/// The answer: images (base64) and everything stored in them.
fn answer(id: &str, output: &JobOutput, format: ImageFormat) -> serde_json::Value {
    let b64 = base64::engine::general_purpose::STANDARD;
    let metadata: serde_json::Map<String, serde_json::Value> = output
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::Value::from(v.clone())))
        .collect();
    let timings: serde_json::Map<String, serde_json::Value> = output
        .timings
        .iter()
        .map(|(stage, s)| (stage.to_string(), serde_json::Value::from(*s)))
        .collect();
    serde_json::json!({
        "id": id,
        "seed": output.seed,
        "width": output.width,
        "height": output.height,
        "steps": output.steps,
        "guidance": output.guidance,
        "prompt_truncated": output.prompt_truncated,
        "warnings": output.warnings,
        "format": format_name(format),
        "metadata": metadata,
        "timings": timings,
        "images": output.images.iter().map(|i| b64.encode(i)).collect::<Vec<_>>(),
    })
}

pub(crate) async fn generate(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<axum::body::Bytes, BytesRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let id = request_id(&headers)?;
    let (spec, format) = spec_from(&state, parse_json(body)?)?;
    let (id, output) = run_to_end(&state, spec, id).await?;
    Ok(Json(answer(&id, &output, format)))
}

/// What the event stream still has to do.
struct StreamState {
    handle: Option<JobHandle>,
    format: ImageFormat,
    deadline: tokio::time::Instant,
    /// `--timeout`, for the message when the deadline passes.
    timeout: std::time::Duration,
    /// The first event, `queued`, not yet sent.
    queued: Option<serde_json::Value>,
}

pub(crate) async fn generate_stream(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<axum::body::Bytes, BytesRejection>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let id = request_id(&headers)?;
    let (spec, format) = spec_from(&state, parse_json(body)?)?;
    let submitted = super::submit(&state, spec, id)?;
    let queued = serde_json::json!({
        "id": submitted.handle.id, "position": submitted.position, "ahead": submitted.ahead,
    });
    let start = StreamState {
        handle: Some(submitted.handle),
        format,
        deadline: tokio::time::Instant::now() + state.timeout,
        timeout: state.timeout,
        queued: Some(queued),
    };
    // The handle lives in the stream: when the client disconnects, the stream is dropped, and
    // with it the handle, which cancels the job.
    let events = stream::unfold(start, |mut s| async move {
        if let Some(queued) = s.queued.take() {
            return Some((Ok(event("queued", &queued)), s));
        }
        let handle = s.handle.as_mut()?;
        let next = tokio::time::timeout_at(s.deadline, handle.next()).await;
        let event = match next {
            Err(_) => {
                let e = timed_out(s.timeout);
                s.handle = None; // dropped: cancels the job
                event("error", &e.body())
            }
            Ok(None) => {
                s.handle = None;
                event(
                    "error",
                    &ApiError::new(ErrorKind::Server, "the pipeline stopped").body(),
                )
            }
            Ok(Some(JobEvent::Done(result))) => {
                let id = handle.id.clone();
                s.handle = None;
                match result {
                    Ok(output) => event("done", &answer(&id, &output, s.format)),
                    Err(e) => event("error", &e.body()),
                }
            }
            Ok(Some(JobEvent::Started)) => event("started", &serde_json::json!({})),
            Ok(Some(JobEvent::StageStarted(stage))) => event(
                "stage",
                &serde_json::json!({ "stage": stage, "state": "started" }),
            ),
            Ok(Some(JobEvent::StageFinished(stage, seconds))) => event(
                "stage",
                &serde_json::json!({ "stage": stage, "state": "finished", "seconds": seconds }),
            ),
            Ok(Some(JobEvent::Step { step, total })) => {
                event("step", &serde_json::json!({ "step": step, "total": total }))
            }
            Ok(Some(JobEvent::Preview {
                step,
                total,
                images,
            })) => {
                let b64 = base64::engine::general_purpose::STANDARD;
                let images: Vec<String> = images.iter().map(|png| b64.encode(png)).collect();
                event(
                    "preview",
                    &serde_json::json!({ "step": step, "total": total, "images": images }),
                )
            }
        };
        Some((Ok(event), s))
    });
    // Keep-alive comments: proxies keep the stream open, and a gone client is noticed.
    Ok(Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(5))))
}

fn event(name: &str, data: &serde_json::Value) -> Event {
    Event::default().event(name).data(data.to_string())
}

pub(crate) async fn cancel(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    if state.queue.cancel(&id) {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::new(
            ErrorKind::NotFound,
            format!(
                "no queued or running request has id {}",
                id.chars().take(64).collect::<String>()
            ),
        ))
    }
}
