//! The OpenAI images API: `POST /v1/images/generations` (JSON) and `POST /v1/images/edits`
//! (multipart, the references as `image`/`image[]`), answered with `b64_json` images, so the
//! official clients work with `base_url` pointed here. klein's options (`seed`, `steps`,
//! `guidance`, `loras`) are extra fields (the Python client's `extra_body`).
use std::sync::Arc;

use axum::extract::multipart::{Field, MultipartRejection};
use axum::extract::rejection::BytesRejection;
use axum::extract::{Multipart, State};
use axum::http::HeaderMap;
use axum::Json;
use base64::Engine;
use klein::limits::MAX_LORAS;
use klein::pipeline::{ImageInput, MaskKind, RequestSpec};
use serde::Deserialize;

use super::error::{ApiError, ErrorKind};
use super::jobs::{JobOutput, JobSpec, Upload};
use super::params::{
    at_most, check_response_format, image_format, parse_size, whole, OPENAI_FORMAT_FIELDS,
};
use super::{parse_json, request_id, run_to_end, too_large, AppState};

/// The body of `POST /v1/images/generations`. Unknown fields are refused (a misspelt option
/// would otherwise be silently ignored).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerationsBody {
    prompt: String,
    /// Any name: the server runs the model it was started with (`GET /v1/models`).
    #[allow(dead_code)] // accepted, unused
    model: Option<String>,
    n: Option<u64>,
    size: Option<String>,
    response_format: Option<String>,
    output_format: Option<String>,
    output_compression: Option<u64>,
    /// OpenAI's end-user ids.
    #[allow(dead_code)] // accepted, unused
    user: Option<String>,
    #[allow(dead_code)] // accepted, unused
    safety_identifier: Option<String>,
    quality: Option<String>,
    /// OpenAI's settings klein has one answer to: see [`openai_settings`].
    background: Option<String>,
    moderation: Option<String>,
    style: Option<String>,
    stream: Option<bool>,
    partial_images: Option<u64>,
    // klein's extensions.
    seed: Option<u64>,
    steps: Option<u64>,
    guidance: Option<f64>,
    negative_prompt: Option<String>,
    #[serde(default, deserialize_with = "at_most::<_, _, MAX_LORAS>")]
    loras: Vec<String>,
}

pub(crate) async fn generations(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<axum::body::Bytes, BytesRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let id = request_id(&headers)?;
    let body: GenerationsBody = parse_json(body)?;
    let notes = openai_settings(&body)?;
    let spec = spec_from(&state, body, Vec::new(), None)?;
    let (_, output) = run_to_end(&state, spec, id).await?;
    Ok(Json(answer(&output, notes)))
}

/// Where a client that asked OpenAI's route to stream is sent.
const STREAM_ELSEWHERE: &str = "klein streams a generation's steps and previews as server-sent events on POST /v1/klein/generate/stream (its JSON body as POST /v1/klein/generate's: width, height, num_images...); give stream false or leave it out here";

/// OpenAI's fields for what klein does one way only: the values that ask for that way are
/// accepted, the others refused naming the field (an edited image, not an ignored wish). Returns
/// the answer's warnings for accepted fields that change nothing.
fn openai_settings(body: &GenerationsBody) -> Result<Vec<String>, ApiError> {
    if let Some(background) = body.background.as_deref() {
        if !matches!(background, "auto" | "opaque") {
            return Err(ApiError::field(
                "background",
                format!("background `{background}`: klein's images are opaque (no alpha channel); give auto or opaque"),
            ));
        }
    }
    if let Some(style) = body.style.as_deref() {
        return Err(ApiError::field(
            "style",
            format!("style `{style}`: klein has no style presets (DALL-E 3's vivid and natural); describe the style in the prompt"),
        ));
    }
    if body.stream == Some(true) {
        return Err(ApiError::field("stream", STREAM_ELSEWHERE));
    }
    if let Some(n @ 1..) = body.partial_images {
        return Err(ApiError::field(
            "partial_images",
            format!("partial_images {n}: partial images come with stream, which this route does not do; {STREAM_ELSEWHERE}"),
        ));
    }
    match body.moderation.as_deref() {
        None => Ok(Vec::new()),
        Some(level @ ("auto" | "low")) => Ok(vec![format!(
            "moderation `{level}` changed nothing: klein moderates no prompt or image"
        )]),
        Some(other) => Err(ApiError::field(
            "moderation",
            format!("moderation `{other}`: give auto or low (klein moderates nothing at either)"),
        )),
    }
}

/// An edit's source image, its mask (transparent where to edit) and strength.
type Edit = (Upload, Option<Upload>, Option<f64>);

/// Builds the job and checks it (every number, rule and image header) before it is queued.
fn spec_from(
    state: &AppState,
    body: GenerationsBody,
    references: Vec<Upload>,
    edit: Option<Edit>,
) -> Result<JobSpec, ApiError> {
    check_response_format(body.response_format.as_deref())?;
    check_quality(body.quality.as_deref())?;
    let (width, height) = parse_size(body.size.as_deref())?;
    let mut request = RequestSpec::new(body.prompt);
    (request.width, request.height) = (width, height);
    request.steps = body.steps.map(whole);
    request.guidance = body.guidance;
    request.negative_prompt = check_negative_prompt(state, body.negative_prompt)?;
    request.seed = body.seed;
    request.num_images = body.n.map_or(1, whole);
    request.loras = Some(state.loras.resolve_all(&body.loras)?);
    let format = image_format(
        body.output_format.as_deref(),
        body.output_compression,
        OPENAI_FORMAT_FIELDS,
    )?;
    let mut spec = JobSpec::new(request, ("n", "image"), Some("size"), format);
    if let Some((source, mask, strength)) = edit {
        spec.request.source = Some(ImageInput::encoded(source.bytes, source.label));
        spec.request.mask = mask.map(|m| ImageInput::encoded(m.bytes, m.label));
        spec.request.mask_kind = MaskKind::Transparent;
        spec.request.strength = strength;
    }
    for reference in references {
        spec.add_reference(reference);
    }
    spec.request.check().map_err(|e| spec.api_error(e))?;
    Ok(spec)
}

/// OpenAI's `quality`: klein has one quality; `auto` and `standard` are accepted.
fn check_quality(quality: Option<&str>) -> Result<(), ApiError> {
    match quality {
        None | Some("auto" | "standard") => Ok(()),
        Some(other) => Err(ApiError::field(
            "quality",
            format!("quality `{other}`: klein has one quality; give auto or standard, and steps for more denoising"),
        )),
    }
}

/// A negative prompt needs guidance, which distilled models do not run: refused there, naming
/// the field (the library refuses guidance 1 or less on base models).
pub(crate) fn check_negative_prompt(
    state: &AppState,
    negative: Option<String>,
) -> Result<Option<String>, ApiError> {
    match negative {
        Some(n) if state.distilled && !n.is_empty() => Err(ApiError::field(
            "negative_prompt",
            format!(
                "negative_prompt needs classifier-free guidance, and {} is a distilled model (it runs without guidance); serve a base model",
                state.model_name
            ),
        )),
        other => Ok(other),
    }
}

/// The OpenAI answer, with klein's settings beside it; `notes`: warnings of the request's own.
fn answer(output: &JobOutput, notes: Vec<String>) -> serde_json::Value {
    let b64 = base64::engine::general_purpose::STANDARD;
    let created = super::unix_seconds();
    let data: Vec<serde_json::Value> = output
        .images
        .iter()
        .map(|image| serde_json::json!({ "b64_json": b64.encode(image) }))
        .collect();
    let warnings = [notes, output.warnings.clone()].concat();
    serde_json::json!({
        "created": created,
        "data": data,
        "seed": output.seed,
        "width": output.width,
        "height": output.height,
        "steps": output.steps,
        "guidance": output.guidance,
        "warnings": warnings,
    })
}

/// Text fields of the edits form, as [`GenerationsBody`] has them.
const TEXT_FIELDS: [&str; 19] = [
    "prompt",
    "model",
    "n",
    "size",
    "response_format",
    "output_format",
    "output_compression",
    "user",
    "safety_identifier",
    "quality",
    "background",
    "moderation",
    "style",
    "stream",
    "partial_images",
    "seed",
    "steps",
    "guidance",
    "negative_prompt",
];

pub(crate) async fn edits(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    form: Result<Multipart, MultipartRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let id = request_id(&headers)?;
    let mut form = form.map_err(|rejection| {
        let content_type = headers
            .get(axum::http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("none");
        let why = if content_type.starts_with("multipart/form-data") {
            rejection.body_text()
        } else {
            format!("this body's Content-Type is {content_type}; JSON goes to POST /v1/klein/generate")
        };
        ApiError::new(
            ErrorKind::InvalidRequest,
            format!("/v1/images/edits takes multipart/form-data, as OpenAI's (image[] files and text fields): {why}"),
        )
    })?;
    let mut body = serde_json::Map::new();
    let mut loras = Vec::new();
    let mut references = Vec::new();
    let mut mask = None;
    let mut strength = None;
    let mut fidelity = None;
    while let Some(field) = form.next_field().await.map_err(multipart_error)? {
        let name = field.name().unwrap_or_default().to_string();
        match name.as_str() {
            "image" | "image[]" => {
                // Counted as they come: a form of thousands of images is refused at the first
                // one past the bound, not read whole.
                klein::pipeline::request::check_reference_count(references.len() + 1)
                    .map_err(|e| ApiError::from_klein(&e, Some("image")))?;
                let label = field
                    .file_name()
                    .map(str::to_string)
                    .unwrap_or_else(|| format!("image-{}", references.len()));
                let bytes = field.bytes().await.map_err(multipart_error)?;
                references.push(Upload {
                    label,
                    bytes: bytes.to_vec(),
                    field: "image".into(),
                });
            }
            "mask" => {
                if mask.is_some() {
                    return Err(ApiError::field("mask", "give one mask"));
                }
                let label = field.file_name().unwrap_or("mask").to_string();
                let bytes = field.bytes().await.map_err(multipart_error)?;
                mask = Some(Upload {
                    label,
                    bytes: bytes.to_vec(),
                    field: "mask".into(),
                });
            }
            "strength" => {
                if strength.is_some() {
                    return Err(ApiError::field("strength", "duplicate field `strength`"));
                }
                let value = field_text(field, "strength").await?;
                let parsed = value.trim().parse::<f64>().map_err(|_| {
                    ApiError::field("strength", format!("strength `{value}`: give a number"))
                })?;
                strength = Some(parsed);
            }
            "input_fidelity" => {
                if fidelity.is_some() {
                    return Err(ApiError::field("input_fidelity", "duplicate field `input_fidelity`"));
                }
                fidelity = Some(check_fidelity(field_text(field, "input_fidelity").await?)?);
            }
            "loras" | "loras[]" => {
                if loras.len() == MAX_LORAS {
                    return Err(ApiError::field(
                        "loras",
                        format!("more than {MAX_LORAS} loras fields: at most {MAX_LORAS} LoRAs can be applied at once"),
                    ));
                }
                loras.push(field_text(field, "loras").await?);
            }
            text if TEXT_FIELDS.contains(&text) => {
                // As the JSON routes: a second value is refused, not the last one taken.
                if body.contains_key(text) {
                    return Err(ApiError::field(text, format!("duplicate field `{text}`")));
                }
                let value = field_text(field, text).await?;
                body.insert(name.clone(), form_value(&name, value)?);
            }
            other => {
                return Err(ApiError::field(
                    other,
                    format!("unknown field `{}`; the form takes image[] (files), mask (a PNG, transparent where to edit), strength, input_fidelity, loras (one field per LoRA), and {}", other.chars().take(40).collect::<String>(), TEXT_FIELDS.join(", ")),
                ))
            }
        }
    }
    if references.is_empty() {
        return Err(ApiError::field(
            "image",
            "give at least one image (the image or image[] field)",
        ));
    }
    if !loras.is_empty() {
        body.insert("loras".into(), serde_json::json!(loras));
    }
    let body: GenerationsBody = super::parse_value(serde_json::Value::Object(body))?;
    let mut notes = openai_settings(&body)?;
    notes.extend(fidelity);
    // With a mask (or a strength), the first image is the one edited, the others references.
    let edit =
        (mask.is_some() || strength.is_some()).then(|| (references.remove(0), mask, strength));
    let spec = spec_from(&state, body, references, edit)?;
    let (_, output) = run_to_end(&state, spec, id).await?;
    Ok(Json(answer(&output, notes)))
}

/// OpenAI's `input_fidelity` of edits: `high` or `low`, the answer's warning for either (klein's
/// model reads its images one way).
fn check_fidelity(value: String) -> Result<String, ApiError> {
    match value.trim() {
        level @ ("high" | "low") => Ok(format!(
            "input_fidelity `{level}` changed nothing: klein's model reads its images one way"
        )),
        other => Err(ApiError::field(
            "input_fidelity",
            format!("input_fidelity `{other}`: give high or low (klein reads its images one way at either)"),
        )),
    }
}

/// A form field's text as the JSON value the body's type takes: numbers for the numeric fields.
fn form_value(name: &str, value: String) -> Result<serde_json::Value, ApiError> {
    match name {
        "n" | "output_compression" | "partial_images" | "seed" | "steps" => value
            .trim()
            .parse::<u64>()
            .map(serde_json::Value::from)
            .map_err(|_| {
                ApiError::field(
                    name,
                    format!(
                        "{name} `{value}`: give {}",
                        super::valid_numbers(name).unwrap_or_default()
                    ),
                )
            }),
        "guidance" => value
            .trim()
            .parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
            .map(serde_json::Value::Number)
            .ok_or_else(|| {
                ApiError::field(
                    name,
                    format!(
                        "{name} `{value}`: give {}",
                        super::valid_numbers(name).unwrap_or_default()
                    ),
                )
            }),
        "stream" => match value.trim() {
            "true" => Ok(serde_json::Value::Bool(true)),
            "false" => Ok(serde_json::Value::Bool(false)),
            other => Err(ApiError::field(
                name,
                format!("stream `{other}`: give false ({STREAM_ELSEWHERE})"),
            )),
        },
        _ => Ok(serde_json::Value::String(value)),
    }
}

/// A text field's value: UTF-8 text, not a file (`curl -F prompt=@file`) nor bytes that would be
/// read with replacement characters.
async fn field_text(field: Field<'_>, name: &str) -> Result<String, ApiError> {
    if let Some(file) = field.file_name() {
        return Err(ApiError::field(
            name,
            format!(
                "{name} is a file (`{}`) where text belongs: give it as a text field",
                file.chars().take(40).collect::<String>()
            ),
        ));
    }
    let bytes = field.bytes().await.map_err(multipart_error)?;
    String::from_utf8(bytes.to_vec()).map_err(|e| {
        ApiError::field(
            name,
            format!("{name} is not UTF-8 text: {}", e.utf8_error()),
        )
    })
}

fn multipart_error(error: axum::extract::multipart::MultipartError) -> ApiError {
    if error.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
        return too_large();
    }
    ApiError::new(
        ErrorKind::InvalidRequest,
        format!("multipart body: {}", error.body_text()),
    )
}
