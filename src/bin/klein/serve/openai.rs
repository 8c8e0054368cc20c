//! The OpenAI images API: `POST /v1/images/generations` (JSON) and `POST /v1/images/edits`
//! (multipart, the references as `image`/`image[]`), answered with `b64_json` images, so the
//! official clients work with `base_url` pointed here. The request schema and the answer are the
//! library's ([`klein::api::openai`], which the Ray Serve deployment shares); this module reads
//! the bodies, resolves the LoRAs in `--lora-dir`, and runs the job.
use std::sync::Arc;

use axum::extract::multipart::MultipartRejection;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Multipart, State};
use axum::http::HeaderMap;
use axum::Json;
use klein::api::openai::{self, answer, EditForm, OpenAiRequest};

use super::error::{ApiError, ErrorKind};
use super::{request_id, run_to_end, too_large, AppState};

pub(crate) async fn generations(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Result<axum::body::Bytes, BytesRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let id = request_id(&headers)?;
    let bytes = body.map_err(|rejection| {
        if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
            return too_large();
        }
        ApiError::new(
            ErrorKind::InvalidRequest,
            format!("request body: {}", rejection.body_text()),
        )
    })?;
    run(&state, openai::generations(&bytes)?, id).await
}

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
    let mut edit = EditForm::default();
    while let Some(field) = form.next_field().await.map_err(multipart_error)? {
        let name = field.name().unwrap_or_default().to_string();
        if EditForm::is_image(&name) {
            // Counted as they come: a form of thousands of images is refused at the first one
            // past the bound, not read whole.
            edit.check_next_image()?;
        }
        let file_name = field.file_name().map(str::to_string);
        let bytes = field.bytes().await.map_err(multipart_error)?;
        edit.add_part(&name, file_name.as_deref(), bytes.to_vec())?;
    }
    run(&state, edit.finish()?, id).await
}

/// Runs a checked request: its LoRAs resolved in `--lora-dir`, queued, answered.
async fn run(
    state: &AppState,
    request: OpenAiRequest,
    id: Option<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let OpenAiRequest {
        mut job,
        loras,
        notes,
    } = request;
    job.request.loras = Some(state.loras.resolve_all(&loras)?);
    let (_, output) = run_to_end(state, job, id).await?;
    Ok(Json(answer(&output, notes)))
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
