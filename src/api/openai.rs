//! The OpenAI images API, as `klein serve` and the Ray Serve deployment (through the Python
//! bindings) both take it: `POST /v1/images/generations` (a JSON body, [`generations`]) and
//! `POST /v1/images/edits` (a multipart form, [`EditForm`]), each made into a checked [`Job`];
//! and the answer ([`answer`]). klein's options (`seed`, `steps`, `guidance`, `negative_prompt`,
//! `loras`) are extra fields (the Python client's `extra_body`).
use base64::Engine;
use serde::Deserialize;

use super::{
    at_most, check_response_format, image_format, parse_json, parse_size, parse_value,
    valid_numbers, whole, FieldError, Job, Output, Upload, OPENAI_FORMAT_FIELDS,
};
use crate::limits::MAX_LORAS;
use crate::pipeline::request::check_reference_count;
use crate::pipeline::{ImageInput, MaskKind, RequestSpec};

/// The body of `POST /v1/images/generations`. Unknown fields are refused (a misspelt option
/// would otherwise be silently ignored).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerationsBody {
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

/// Where a client that asked OpenAI's route to stream is sent.
const STREAM_ELSEWHERE: &str = "klein streams a generation's steps and previews as server-sent events on POST /v1/klein/generate/stream (its JSON body as POST /v1/klein/generate's: width, height, num_images...); give stream false or leave it out here";

/// OpenAI's fields for what klein does one way only: the values that ask for that way are
/// accepted, the others refused naming the field (an edited image, not an ignored wish). Returns
/// the answer's warnings for accepted fields that change nothing.
fn openai_settings(body: &GenerationsBody) -> Result<Vec<String>, FieldError> {
    if let Some(background) = body.background.as_deref() {
        if !matches!(background, "auto" | "opaque") {
            return Err(FieldError::new(
                "background",
                format!("background `{background}`: klein's images are opaque (no alpha channel); give auto or opaque"),
            ));
        }
    }
    if let Some(style) = body.style.as_deref() {
        return Err(FieldError::new(
            "style",
            format!("style `{style}`: klein has no style presets (DALL-E 3's vivid and natural); describe the style in the prompt"),
        ));
    }
    if body.stream == Some(true) {
        return Err(FieldError::new("stream", STREAM_ELSEWHERE));
    }
    if let Some(n @ 1..) = body.partial_images {
        return Err(FieldError::new(
            "partial_images",
            format!("partial_images {n}: partial images come with stream, which this route does not do; {STREAM_ELSEWHERE}"),
        ));
    }
    match body.moderation.as_deref() {
        None => Ok(Vec::new()),
        Some(level @ ("auto" | "low")) => Ok(vec![format!(
            "moderation `{level}` changed nothing: klein moderates no prompt or image"
        )]),
        Some(other) => Err(FieldError::new(
            "moderation",
            format!("moderation `{other}`: give auto or low (klein moderates nothing at either)"),
        )),
    }
}

/// A checked OpenAI request: the job, the LoRAs it names (the host resolves them: `klein serve`
/// in its `--lora-dir`), and the answer's warnings of the request's own (settings that change
/// nothing).
#[derive(Debug, Clone)]
pub struct OpenAiRequest {
    pub job: Job,
    pub loras: Vec<String>,
    pub notes: Vec<String>,
}

/// An edit's source image, its mask (transparent where to edit) and strength.
type Edit = (Upload, Option<Upload>, Option<f64>);

/// `POST /v1/images/generations`: the JSON body, checked (every field, number and rule).
pub fn generations(body: &[u8]) -> Result<OpenAiRequest, FieldError> {
    let body: GenerationsBody = parse_json(body)?;
    request(body, Vec::new(), None, Vec::new())
}

/// Builds the job and checks it (every number, rule and image header).
fn request(
    body: GenerationsBody,
    references: Vec<Upload>,
    edit: Option<Edit>,
    mut notes: Vec<String>,
) -> Result<OpenAiRequest, FieldError> {
    notes.splice(0..0, openai_settings(&body)?);
    check_response_format(body.response_format.as_deref())?;
    check_quality(body.quality.as_deref())?;
    let (width, height) = parse_size(body.size.as_deref())?;
    let mut spec = RequestSpec::new(body.prompt);
    (spec.width, spec.height) = (width, height);
    spec.steps = body.steps.map(whole);
    spec.guidance = body.guidance;
    spec.negative_prompt = body.negative_prompt;
    spec.seed = body.seed;
    spec.num_images = body.n.map_or(1, whole);
    let format = image_format(
        body.output_format.as_deref(),
        body.output_compression,
        OPENAI_FORMAT_FIELDS,
    )?;
    let mut job = Job::new(spec, ("n", "image"), Some("size"), format);
    if let Some((source, mask, strength)) = edit {
        job.request.source = Some(ImageInput::encoded(source.bytes, source.label));
        job.request.mask = mask.map(|m| ImageInput::encoded(m.bytes, m.label));
        job.request.mask_kind = MaskKind::Transparent;
        job.request.strength = strength;
    }
    for reference in references {
        job.add_reference(reference);
    }
    job.check()?;
    Ok(OpenAiRequest {
        job,
        loras: body.loras,
        notes,
    })
}

/// OpenAI's `quality`: klein has one quality; `auto` and `standard` are accepted.
fn check_quality(quality: Option<&str>) -> Result<(), FieldError> {
    match quality {
        None | Some("auto" | "standard") => Ok(()),
        Some(other) => Err(FieldError::new(
            "quality",
            format!("quality `{other}`: klein has one quality; give auto or standard, and steps for more denoising"),
        )),
    }
}

/// The OpenAI answer, with klein's settings beside it; `notes`: warnings of the request's own.
pub fn answer(output: &Output, notes: Vec<String>) -> serde_json::Value {
    let b64 = base64::engine::general_purpose::STANDARD;
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
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

/// `POST /v1/images/edits`: the multipart form, read part by part ([`EditForm::add_part`]), then
/// checked as a whole ([`EditForm::finish`]).
#[derive(Debug, Default)]
pub struct EditForm {
    body: serde_json::Map<String, serde_json::Value>,
    loras: Vec<String>,
    references: Vec<Upload>,
    mask: Option<Upload>,
    strength: Option<f64>,
    fidelity: Option<String>,
}

impl EditForm {
    /// Whether a part of this name is an image (`image`, `image[]`): count it with
    /// [`EditForm::check_next_image`] before its bytes are read.
    pub fn is_image(name: &str) -> bool {
        matches!(name, "image" | "image[]")
    }

    /// Refuses an image past [`crate::limits::MAX_REFERENCES`], before it is read: a form of thousands of images
    /// is refused at the first one past the bound, not read whole.
    pub fn check_next_image(&self) -> Result<(), FieldError> {
        check_reference_count(self.references.len() + 1)
            .map_err(|e| FieldError::new("image", e.to_string()))
    }

    /// One part of the form: its field name, its file name (a file) or none (a text field), and
    /// its bytes.
    pub fn add_part(
        &mut self,
        name: &str,
        file_name: Option<&str>,
        bytes: Vec<u8>,
    ) -> Result<(), FieldError> {
        match name {
            "image" | "image[]" => {
                self.check_next_image()?;
                let label = file_name
                    .map(str::to_string)
                    .unwrap_or_else(|| format!("image-{}", self.references.len()));
                self.references.push(Upload {
                    label,
                    bytes,
                    field: "image".into(),
                });
            }
            "mask" => {
                if self.mask.is_some() {
                    return Err(FieldError::new("mask", "give one mask"));
                }
                self.mask = Some(Upload {
                    label: file_name.unwrap_or("mask").to_string(),
                    bytes,
                    field: "mask".into(),
                });
            }
            "strength" => {
                if self.strength.is_some() {
                    return Err(FieldError::new("strength", "duplicate field `strength`"));
                }
                let value = text(name, file_name, bytes)?;
                let parsed = value.trim().parse::<f64>().map_err(|_| {
                    FieldError::new("strength", format!("strength `{value}`: give a number"))
                })?;
                self.strength = Some(parsed);
            }
            "input_fidelity" => {
                if self.fidelity.is_some() {
                    return Err(FieldError::new(
                        "input_fidelity",
                        "duplicate field `input_fidelity`",
                    ));
                }
                self.fidelity = Some(check_fidelity(text(name, file_name, bytes)?)?);
            }
            "loras" | "loras[]" => {
                if self.loras.len() == MAX_LORAS {
                    return Err(FieldError::new(
                        "loras",
                        format!("more than {MAX_LORAS} loras fields: at most {MAX_LORAS} LoRAs can be applied at once"),
                    ));
                }
                self.loras.push(text("loras", file_name, bytes)?);
            }
            field if TEXT_FIELDS.contains(&field) => {
                // As the JSON routes: a second value is refused, not the last one taken.
                if self.body.contains_key(field) {
                    return Err(FieldError::new(field, format!("duplicate field `{field}`")));
                }
                let value = text(field, file_name, bytes)?;
                self.body.insert(field.to_string(), form_value(field, value)?);
            }
            other => {
                return Err(FieldError::new(
                    other,
                    format!("unknown field `{}`; the form takes image[] (files), mask (a PNG, transparent where to edit), strength, input_fidelity, loras (one field per LoRA), and {}", other.chars().take(40).collect::<String>(), TEXT_FIELDS.join(", ")),
                ))
            }
        }
        Ok(())
    }

    /// The request of the whole form, checked.
    pub fn finish(mut self) -> Result<OpenAiRequest, FieldError> {
        if self.references.is_empty() {
            return Err(FieldError::new(
                "image",
                "give at least one image (the image or image[] field)",
            ));
        }
        if !self.loras.is_empty() {
            self.body
                .insert("loras".into(), serde_json::json!(self.loras));
        }
        let body: GenerationsBody = parse_value(serde_json::Value::Object(self.body))?;
        // With a mask (or a strength), the first image is the one edited, the others references.
        let mut references = self.references;
        let edit = (self.mask.is_some() || self.strength.is_some())
            .then(|| (references.remove(0), self.mask, self.strength));
        request(body, references, edit, self.fidelity.into_iter().collect())
    }
}

/// A text field's value: UTF-8 text, not a file (`curl -F prompt=@file`) nor bytes that would be
/// read with replacement characters.
fn text(name: &str, file_name: Option<&str>, bytes: Vec<u8>) -> Result<String, FieldError> {
    if let Some(file) = file_name {
        return Err(FieldError::new(
            name,
            format!(
                "{name} is a file (`{}`) where text belongs: give it as a text field",
                file.chars().take(40).collect::<String>()
            ),
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        FieldError::new(
            name,
            format!("{name} is not UTF-8 text: {}", e.utf8_error()),
        )
    })
}

/// OpenAI's `input_fidelity` of edits: `high` or `low`, the answer's warning for either (klein's
/// model reads its images one way).
fn check_fidelity(value: String) -> Result<String, FieldError> {
    match value.trim() {
        level @ ("high" | "low") => Ok(format!(
            "input_fidelity `{level}` changed nothing: klein's model reads its images one way"
        )),
        other => Err(FieldError::new(
            "input_fidelity",
            format!("input_fidelity `{other}`: give high or low (klein reads its images one way at either)"),
        )),
    }
}

/// A form field's text as the JSON value the body's type takes: numbers for the numeric fields.
fn form_value(name: &str, value: String) -> Result<serde_json::Value, FieldError> {
    match name {
        "n" | "output_compression" | "partial_images" | "seed" | "steps" => value
            .trim()
            .parse::<u64>()
            .map(serde_json::Value::from)
            .map_err(|_| {
                FieldError::new(
                    name,
                    format!(
                        "{name} `{value}`: give {}",
                        valid_numbers(name).unwrap_or_default()
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
                FieldError::new(
                    name,
                    format!(
                        "{name} `{value}`: give {}",
                        valid_numbers(name).unwrap_or_default()
                    ),
                )
            }),
        "stream" => match value.trim() {
            "true" => Ok(serde_json::Value::Bool(true)),
            "false" => Ok(serde_json::Value::Bool(false)),
            other => Err(FieldError::new(
                name,
                format!("stream `{other}`: give false ({STREAM_ELSEWHERE})"),
            )),
        },
        _ => Ok(serde_json::Value::String(value)),
    }
}
