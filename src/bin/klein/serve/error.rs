//! Errors as clients see them: an HTTP status and the OpenAI error body,
//! `{"error": {"message", "type", "param", "code"}}`, `param` naming the request field at fault.
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use klein::api::{FieldError, Job};
use klein::pipeline::SpecError;
use klein::KleinError;

/// What went wrong, for the body's `type` and the `klein_errors_total{kind}` metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorKind {
    /// A bad field, body, image or option (400).
    InvalidRequest,
    /// No or a wrong bearer token (401).
    Authentication,
    /// No such route or job (404).
    NotFound,
    /// A route asked with another method than its own (405).
    MethodNotAllowed,
    /// A body over `--max-body-mib` (413).
    TooLarge,
    /// A body in a `Content-Encoding` this server does not decode (415).
    UnsupportedEncoding,
    /// A body that did not all arrive within `--timeout` (408).
    SlowBody,
    /// The queue is full (429, with Retry-After).
    QueueFull,
    /// Cancelled by `DELETE /v1/klein/jobs/{id}` (409).
    Cancelled,
    /// Over `--timeout` (504).
    Timeout,
    /// The server is shutting down or still loading (503).
    Unavailable,
    /// The runtime failed (500).
    Server,
}

impl ErrorKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            ErrorKind::InvalidRequest => "invalid_request_error",
            ErrorKind::Authentication => "authentication_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::MethodNotAllowed => "method_not_allowed",
            ErrorKind::TooLarge => "payload_too_large",
            ErrorKind::UnsupportedEncoding => "unsupported_media_type",
            ErrorKind::SlowBody => "request_timeout",
            ErrorKind::QueueFull => "queue_full",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::Timeout => "timeout",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Server => "server_error",
        }
    }

    fn status(self) -> StatusCode {
        match self {
            ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Authentication => StatusCode::UNAUTHORIZED,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::UnsupportedEncoding => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorKind::SlowBody => StatusCode::REQUEST_TIMEOUT,
            ErrorKind::QueueFull => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::Cancelled => StatusCode::CONFLICT,
            ErrorKind::Timeout => StatusCode::GATEWAY_TIMEOUT,
            ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Server => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub(crate) kind: ErrorKind,
    pub(crate) param: Option<String>,
    pub(crate) message: String,
    /// Seconds, for 429 and 503.
    pub(crate) retry_after: Option<u64>,
}

impl ApiError {
    pub(crate) fn new(kind: ErrorKind, message: impl Into<String>) -> ApiError {
        ApiError {
            kind,
            param: None,
            message: message.into(),
            retry_after: None,
        }
    }

    /// A bad value of the request field `param`.
    pub(crate) fn field(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.to_string()),
            ..ApiError::new(ErrorKind::InvalidRequest, message)
        }
    }

    /// A library error: the client's fault (400) or the runtime's (500); `param` names the field
    /// it came from where the caller knows it.
    pub(crate) fn from_klein(error: &KleinError, param: Option<&str>) -> ApiError {
        let message = klein::error::chain(error);
        match error {
            KleinError::Cancelled => ApiError::new(ErrorKind::Cancelled, "cancelled"),
            e if e.is_user_error() => ApiError {
                param: param.map(str::to_string),
                ..ApiError::new(ErrorKind::InvalidRequest, message)
            },
            _ => ApiError::new(ErrorKind::Server, message),
        }
    }

    /// The JSON body, also sent as the `error` event of a stream.
    pub(crate) fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind.name(),
                "param": self.param,
                "code": serde_json::Value::Null,
            }
        })
    }
}

impl From<FieldError> for ApiError {
    fn from(error: FieldError) -> Self {
        ApiError {
            param: error.param,
            ..ApiError::new(ErrorKind::InvalidRequest, error.message)
        }
    }
}

/// A library error about `job` as the API answers it: the client's field (a 400), or the
/// runtime's failure (a 500).
pub(crate) fn job_error(job: &Job, error: SpecError) -> ApiError {
    match job.error_of(&error) {
        (param, Some(message)) => ApiError {
            param,
            ..ApiError::new(ErrorKind::InvalidRequest, message)
        },
        (param, None) => ApiError::from_klein(&error.error, param.as_deref()),
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.kind.status(), Json(self.body())).into_response();
        if let Some(seconds) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        // For the metrics layer: errors are counted by kind.
        response.extensions_mut().insert(self.kind);
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_errors_are_400_and_runtime_errors_500() {
        let user = KleinError::request("width 5000: at most 4096");
        let e = ApiError::from_klein(&user, Some("size"));
        assert_eq!(e.kind.status(), StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("size"));
        assert!(e.message.contains("4096"), "{}", e.message);
        let runtime = KleinError::Inference {
            stage: "denoise",
            message: "out of memory".into(),
        };
        let e = ApiError::from_klein(&runtime, None);
        assert_eq!(e.kind.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(e.body()["error"]["type"], "server_error");
    }

    #[test]
    fn queue_full_carries_retry_after() {
        let e = ApiError {
            retry_after: Some(7),
            ..ApiError::new(ErrorKind::QueueFull, "queue full")
        };
        let response = e.into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "7");
        assert_eq!(
            response.extensions().get::<ErrorKind>(),
            Some(&ErrorKind::QueueFull)
        );
    }
}
