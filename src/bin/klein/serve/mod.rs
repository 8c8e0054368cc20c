//! `klein serve`: the model behind HTTP. One pipeline per `--device`, each on its own thread
//! ([`worker`]), a bounded queue in front of them ([`jobs`]); axum on tokio for HTTP: the OpenAI
//! images API ([`openai`]), klein's own routes with progress as server-sent events ([`native`]),
//! health, readiness and Prometheus metrics ([`metrics`]); its own accept loop ([`listen`]).
//! Binds 127.0.0.1 unless told otherwise; an optional bearer token; SIGTERM or Ctrl-C stop taking
//! work, finish what was accepted, and exit.
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use klein::api::models;
use klein::pipeline::Pipeline;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};

use crate::args::{check_device_flags, default_model, pipeline_options, ServeArgs};
use crate::UsageError;
use error::{ApiError, ErrorKind};
use jobs::{JobOutput, JobSpec, Queue, Submitted};
use loras::LoraCatalog;
use metrics::{Gauges, Metrics};
use worker::Shared;

mod error;
mod jobs;
mod listen;
mod log;
mod loras;
mod metrics;
mod native;
mod openai;
mod sync;
mod web;
mod worker;

/// What every handler shares.
pub(crate) struct AppState {
    queue: Arc<Queue>,
    metrics: Arc<Metrics>,
    workers: Arc<Shared>,
    pipelines: usize,
    loras: LoraCatalog,
    /// sha256 of the bearer token, when one is required.
    api_key: Option<[u8; 32]>,
    timeout: Duration,
    /// `--max-body-mib` in bytes.
    max_body: usize,
    model_name: String,
    /// The bundle's manifest: the output size of a request that gives it, before it is queued.
    manifest: klein::bundle::Manifest,
    /// When the server started (Unix seconds): the model object's `created`.
    started: u64,
    /// Set by SIGTERM / Ctrl-C: no new work, readiness fails.
    draining: AtomicBool,
    /// The web page at `/` (off with `--no-web`).
    web: bool,
}

pub(crate) fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let devices = &args.devices;
    if (1..devices.len()).any(|i| devices[..i].contains(&devices[i])) {
        return Err(UsageError("a --device is given twice; give each device once".into()).into());
    }
    for &device in devices {
        check_device_flags(&args.load, device).map_err(UsageError)?;
    }
    let api_key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("KLEIN_API_KEY").ok())
        .filter(|k| !k.is_empty());
    let mut loras = LoraCatalog::scan(args.lora_dir.as_deref())?;
    let model = default_model(args.load.model.clone())?;
    // Every pipeline's bundle checks (manifest, hashes) before the port is taken: a bad bundle
    // is an error now, not a server that never gets ready. Graphs load on the workers.
    let pipelines = devices
        .iter()
        .map(|&device| {
            let options = pipeline_options(&args.load, device, Vec::new())
                .with_keep_text_encoder(!args.low_memory)
                .with_release_transformer(args.low_memory);
            Pipeline::load(&model, options)
        })
        .collect::<klein::Result<Vec<_>>>()?;
    for warning in loras.keep_usable(&pipelines[0]) {
        eprintln!("klein serve: warning: {warning}");
    }
    let model_name = pipelines[0].manifest().model.name.clone();

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the HTTP runtime")?;
    runtime.block_on(async move {
        let address = SocketAddr::new(args.host, args.port);
        let listener = tokio::net::TcpListener::bind(address)
            .await
            .map_err(|e| UsageError(format!("cannot listen on {address}: {e}")))?;
        let metrics = Arc::new(Metrics::default());
        let queue = Arc::new(Queue::new(
            args.queue.into(),
            pipelines.len(),
            metrics.clone(),
        ));
        let shared = Arc::new(Shared {
            queue: queue.clone(),
            metrics: metrics.clone(),
            loaded: AtomicUsize::new(0),
            pipelines: pipelines.len(),
            max_pixels: args.max_pixels,
        });
        let state = Arc::new(AppState {
            queue,
            metrics,
            workers: shared.clone(),
            pipelines: pipelines.len(),
            loras,
            api_key: api_key.as_deref().map(digest),
            timeout: Duration::from_secs(args.timeout.into()),
            max_body: usize::from(args.max_body_mib) << 20,
            model_name,
            manifest: pipelines[0].manifest().clone(),
            started: unix_seconds(),
            draining: AtomicBool::new(false),
            web: !args.no_web,
        });
        let threads: Vec<_> = pipelines
            .into_iter()
            .enumerate()
            .map(|(i, pipeline)| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("klein-pipeline-{i}"))
                    .spawn(move || worker::run(i, pipeline, shared))
            })
            .collect::<Result<_, _>>()
            .context("starting the pipeline threads")?;
        let local = listener.local_addr().context("reading the bound address")?;
        eprintln!(
            "klein serve: listening on http://{local} ({} on {}; auth {}); loading the graphs",
            model.display(),
            devices
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            if state.api_key.is_some() {
                "bearer token"
            } else {
                "none"
            }
        );
        if state.web {
            eprintln!("klein serve: web page: http://{local}/ (off with --no-web)");
        }
        if args.lora_dir.is_some() {
            let names: Vec<&str> = state.loras.names().collect();
            eprintln!(
                "klein serve: LoRAs: {}",
                if names.is_empty() {
                    "none (no .safetensors file in --lora-dir)".to_string()
                } else {
                    names.join(", ")
                }
            );
        }
        let app = router(state.clone());
        // Until every accepted job is answered the server still answers: `/readyz` 503, new work
        // 503 (see `listen`).
        let drained = async move {
            shutdown_signal().await;
            eprintln!("klein serve: shutting down: finishing accepted requests, refusing new ones");
            state.draining.store(true, Ordering::SeqCst);
            state.queue.close();
            let workers = tokio::task::spawn_blocking(move || {
                for thread in threads {
                    let _ = thread.join();
                }
            });
            let _ = workers.await;
        };
        listen::serve(listener, app, drained).await;
        eprintln!("klein serve: stopped");
        Ok(())
    })
}

fn router(state: Arc<AppState>) -> Router {
    let max_body = state.max_body;
    let protected = Router::new()
        .route("/v1/images/generations", post(openai::generations))
        .route("/v1/images/edits", post(openai::edits))
        .route("/v1/klein/generate", post(native::generate))
        .route("/v1/klein/generate/stream", post(native::generate_stream))
        .route("/v1/klein/jobs/{id}", delete(native::cancel))
        .route("/v1/klein/loras", get(list_loras))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(retrieve_model))
        .route("/metrics", get(render_metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), read_body))
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    let mut public = Router::new()
        .route(
            "/healthz",
            get(|| async { Json(serde_json::json!({ "status": "ok" })) }),
        )
        .route("/readyz", get(readyz));
    if state.web {
        public = public.merge(web::routes());
    }
    public
        .merge(protected)
        .fallback(|| async { ApiError::new(ErrorKind::NotFound, "no such route; see GET /v1/models, POST /v1/images/generations, POST /v1/klein/generate") })
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            ApiError::new(
                ErrorKind::MethodNotAllowed,
                format!("{method} is not a method of {}: see the routes in klein's docs/server-api.md", uri.path()),
            )
        })
        .layer(DefaultBodyLimit::max(max_body))
        .layer(middleware::from_fn_with_state(state.clone(), count))
        .with_state(state)
}

/// SIGTERM (Kubernetes, systemd) or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

/// The request counts, latencies and errors of `/metrics`.
async fn count(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str)
        .to_string();
    let method = request.method().to_string();
    let mut pending = Pending {
        state: state.clone(),
        route,
        start: Instant::now(),
        done: false,
    };
    let job = Arc::new(std::sync::Mutex::new(None));
    let response = log::JOB_ID.scope(job.clone(), next.run(request)).await;
    let job = job.lock().ok().and_then(|j| j.clone());
    eprintln!(
        "{}",
        log::request_line(
            &method,
            &pending.route,
            response.status().as_u16(),
            job.as_deref(),
            pending.start
        )
    );
    if let Some(kind) = response.extensions().get::<ErrorKind>() {
        state.metrics.count_error(kind.name());
    }
    pending.done = true;
    let seconds = pending.start.elapsed().as_secs_f64();
    state
        .metrics
        .count_request(&pending.route, response.status().as_u16(), seconds);
    response
}

/// A request being answered; dropped before it is (the client went away), it counts as status
/// 499 (nginx's "client closed request").
struct Pending {
    state: Arc<AppState>,
    route: String,
    start: Instant,
    done: bool,
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.done {
            let seconds = self.start.elapsed().as_secs_f64();
            self.state.metrics.count_request(&self.route, 499, seconds);
        }
    }
}

/// `Authorization: Bearer KEY`, compared in constant time (as sha256 digests, so the length of
/// the key does not show either).
async fn authorize(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(want) = &state.api_key else {
        return next.run(request).await;
    };
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        // The scheme's name is case-insensitive (RFC 9110, 11.1).
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim())
        .unwrap_or_default();
    let differs = digest(given)
        .iter()
        .zip(want)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b));
    if differs != 0 {
        let mut response = ApiError::new(
            ErrorKind::Authentication,
            "missing or wrong API key: send Authorization: Bearer KEY",
        )
        .into_response();
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return response;
    }
    next.run(request).await
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    let loaded = state.workers.loaded.load(Ordering::SeqCst);
    let (status, code) = if state.draining.load(Ordering::SeqCst) {
        ("draining", StatusCode::SERVICE_UNAVAILABLE)
    } else if loaded < state.pipelines {
        ("loading", StatusCode::SERVICE_UNAVAILABLE)
    } else {
        ("ready", StatusCode::OK)
    };
    let body = serde_json::json!({
        "status": status, "model": state.model_name,
        "pipelines": state.pipelines, "loaded": loaded,
    });
    (code, Json(body)).into_response()
}

async fn render_metrics(State(state): State<Arc<AppState>>) -> Response {
    let gauges = Gauges {
        waiting: state.queue.waiting(),
        running: state.queue.running.load(Ordering::SeqCst),
        pipelines: state.workers.loaded.load(Ordering::SeqCst),
        ready: !state.draining.load(Ordering::SeqCst)
            && state.workers.loaded.load(Ordering::SeqCst) == state.pipelines,
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(&gauges),
    )
        .into_response()
}

/// OpenAI's model list: the one model this server runs.
async fn list_models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(models::model_list(model_object(&state)))
}

/// `GET /v1/models/{id}` (the OpenAI clients' `models.retrieve`): the one model, by its name.
async fn retrieve_model(
    State(state): State<Arc<AppState>>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    models::retrieve(model_object(&state), &id)
        .map(Json)
        .map_err(|message| ApiError::new(ErrorKind::NotFound, message))
}

/// The model object of this server ([`models::model_object`]), with its `--max-pixels`.
fn model_object(state: &AppState) -> serde_json::Value {
    let max_pixels = Some(state.workers.max_pixels);
    models::model_object(
        &state.manifest,
        &state.model_name,
        state.started,
        max_pixels,
    )
}

/// Seconds since the Unix epoch (0 on a clock set before it).
pub(crate) fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn list_loras(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(serde_json::json!({ "loras": state.loras.names().collect::<Vec<_>>() }))
}

/// Submits `spec` and waits for its result within `--timeout`. If the client goes away first,
/// axum drops this future, and with it the job's handle, which cancels the job.
async fn run_to_end(
    state: &AppState,
    spec: JobSpec,
    id: Option<String>,
) -> Result<(String, JobOutput), ApiError> {
    if state.draining.load(Ordering::SeqCst) {
        return Err(ApiError::new(
            ErrorKind::Unavailable,
            "the server is shutting down",
        ));
    }
    let mut handle = submit(state, spec, id)?.handle;
    match tokio::time::timeout(state.timeout, handle.result()).await {
        Ok(result) => result.map(|output| (handle.id.clone(), output)),
        Err(_) => Err(timed_out(state.timeout)),
    }
}

/// Queues `spec` ([`Queue::submit`]) unless its size alone is over `--max-pixels`: where the body
/// gives the size (no references, no source image), that answer needs no pipeline, and a client
/// should not wait in the queue for it, nor be told to retry it when the queue is full.
fn submit(state: &AppState, spec: JobSpec, id: Option<String>) -> Result<Submitted, ApiError> {
    let asked = &spec.request;
    if asked.references.is_empty() && asked.source.is_none() {
        let mut request = klein::pipeline::Request::new("");
        (request.width, request.height) = (asked.width, asked.height);
        // A size the pipeline refuses is refused by the worker, with its own message.
        if let Ok((width, height)) =
            klein::pipeline::request::output_size(&state.manifest, &request)
        {
            worker::check_pixels(width, height, asked.num_images, state.workers.max_pixels)?;
        }
    }
    state.queue.submit(spec, id)
}

/// A request over `--timeout`, cancelled.
fn timed_out(timeout: std::time::Duration) -> ApiError {
    ApiError::new(
        ErrorKind::Timeout,
        format!(
            "the request took longer than the server's timeout ({} s, klein serve --timeout) and was cancelled",
            timeout.as_secs()
        ),
    )
}

/// The request's body, read whole before its handler runs (after the bearer token is checked):
/// refused at once when its declared length is over `--max-body-mib` (before a client that sent
/// `Expect: 100-continue` is told to go on), and when it has not all arrived within `--timeout`
/// (a client that stalls holds no connection longer than a request may take).
async fn read_body(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|length| length > state.max_body as u64) {
        return too_large().into_response();
    }
    // A compressed body would be read as garbage JSON or form data.
    let encoding = parts.headers.get(header::CONTENT_ENCODING);
    if let Some(encoding) = encoding.filter(|e| !e.as_bytes().eq_ignore_ascii_case(b"identity")) {
        return ApiError::new(
            ErrorKind::UnsupportedEncoding,
            format!(
                "this server reads request bodies as sent, not in Content-Encoding {}; send the body \
                 uncompressed",
                String::from_utf8_lossy(encoding.as_bytes())
            ),
        )
        .into_response();
    }
    let mut stream = body.into_data_stream();
    let mut bytes = Vec::new();
    let read = async {
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::new(ErrorKind::InvalidRequest, format!("request body: {e}"))
            })?;
            if bytes.len() + chunk.len() > state.max_body {
                return Err(too_large());
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(())
    };
    match tokio::time::timeout(state.timeout, read).await {
        Err(_) => ApiError::new(
            ErrorKind::SlowBody,
            format!(
                "the request body did not arrive within the server's timeout ({} s, klein serve --timeout)",
                state.timeout.as_secs()
            ),
        )
        .into_response(),
        Ok(Err(error)) => error.into_response(),
        Ok(Ok(())) => next.run(Request::from_parts(parts, bytes.into())).await,
    }
}

/// A body over `--max-body-mib`.
fn too_large() -> ApiError {
    ApiError::new(
        ErrorKind::TooLarge,
        "the request body is larger than this server takes (klein serve --max-body-mib, 64 MiB by \
         default); send smaller images",
    )
}

/// A JSON object body ([`klein::api::parse_json`]: errors name the field).
fn parse_json<T: DeserializeOwned>(
    body: Result<axum::body::Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            return too_large();
        }
        ApiError::new(
            ErrorKind::InvalidRequest,
            format!("request body: {}", rejection.body_text()),
        )
    })?;
    Ok(klein::api::parse_json(&bytes)?)
}

/// The client's `X-Request-Id` (1-128 of `A-Z a-z 0-9 . _ -`, not `klein-...`), the id
/// `DELETE /v1/klein/jobs/{id}` cancels.
fn request_id(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(value) = headers.get("x-request-id") else {
        return Ok(None);
    };
    let id = value.to_str().unwrap_or_default();
    let valid = (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        && !id.starts_with("klein-");
    if !valid {
        return Err(ApiError::field(
            "X-Request-Id",
            "X-Request-Id: give 1 to 128 characters of A-Z, a-z, 0-9, '.', '_', '-', not starting with klein- (the server's own ids)",
        ));
    }
    Ok(Some(id.to_string()))
}
