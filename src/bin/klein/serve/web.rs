//! The web page at `/`: one HTML file, one script and one style sheet, embedded in the binary
//! (nothing is fetched from elsewhere; no build step). The page uses the server's own routes:
//! `GET /v1/models` for what the model allows, `GET /v1/klein/loras`, `POST
//! /v1/klein/generate/stream` and `DELETE /v1/klein/jobs/{id}`. It is public, as `/healthz` is:
//! with `--api-key` the page asks for the key and sends it with each call. `klein serve --no-web`
//! leaves it out.
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

const INDEX: &str = include_str!("web/index.html");
const SCRIPT: &str = include_str!("web/app.js");
const STYLE: &str = include_str!("web/app.css");

/// Only this server's own origin: no script, style, image or connection from elsewhere.
const CSP: &str =
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; \
                   connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'";

/// The page's routes.
pub(crate) fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/",
            get(|| async { asset(INDEX, "text/html; charset=utf-8") }),
        )
        .route(
            "/web/app.js",
            get(|| async { asset(SCRIPT, "text/javascript; charset=utf-8") }),
        )
        .route(
            "/web/app.css",
            get(|| async { asset(STYLE, "text/css; charset=utf-8") }),
        )
}

fn asset(body: &'static str, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            // The assets change with the binary: browsers ask again each load.
            (header::CACHE_CONTROL, "no-cache"),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}
