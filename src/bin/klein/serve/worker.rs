//! A pipeline's worker thread: takes jobs from the queue one at a time, runs them, and sends
//! their progress and result back. One worker per device; ONNX Runtime's threads do the work.
use std::ops::ControlFlow;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use klein::pipeline::{LoraSpec, Pipeline, Progress};
use klein::stages::output::{encode_image, ImageFormat};

use super::error::{job_error, ApiError, ErrorKind};
use super::jobs::{cancelled, Job, JobEvent, JobOutput, Queue};
use super::metrics::Metrics;

/// What every worker shares: the queue, the metrics, and how many pipelines have loaded their
/// graphs.
pub(crate) struct Shared {
    /// `--max-pixels`: images x width x height of one request.
    pub(crate) max_pixels: u64,
    pub(crate) queue: Arc<Queue>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) loaded: AtomicUsize,
    /// How many pipelines there are (all loaded: the server is ready).
    pub(crate) pipelines: usize,
}

/// Loads every graph of `pipeline` (the `index`-th of `--device`), then runs jobs until the
/// queue is closed and empty.
/// A pipeline whose graphs cannot load ends the process: a server that can never be ready
/// should not look alive.
pub(crate) fn run(index: usize, mut pipeline: Pipeline, shared: Arc<Shared>) {
    if let Err(error) = pipeline.load_all_graphs() {
        eprintln!(
            "klein serve: error: loading the graphs: {}",
            klein::error::chain(&error)
        );
        std::process::exit(if error.is_user_error() { 2 } else { 1 });
    }
    let bundle_hash = match pipeline.bundle_sha256() {
        Ok(hash) => hash,
        Err(error) => {
            eprintln!("klein serve: error: {}", klein::error::chain(&error));
            std::process::exit(1);
        }
    };
    if shared.loaded.fetch_add(1, Ordering::SeqCst) + 1 == shared.pipelines {
        eprintln!(
            "klein serve: {} ready: {} pipeline(s) loaded",
            super::log::utc_now(),
            shared.pipelines
        );
    }
    loop {
        let Some(job) = shared.queue.take() else {
            return; // closed and empty: shutting down
        };
        if job.cancel.load(Ordering::SeqCst) {
            let _ = job.events.send(JobEvent::Done(Err(cancelled())));
            continue;
        }
        shared.queue.running.fetch_add(1, Ordering::SeqCst);
        shared.metrics.count_pipeline_job(index);
        shared
            .metrics
            .observe_queue_wait(job.queued_at.elapsed().as_secs_f64());
        let start = Instant::now();
        let result = catch_unwind(AssertUnwindSafe(|| {
            run_job(&mut pipeline, &job, &bundle_hash, shared.max_pixels)
        }))
        .unwrap_or_else(|_| {
            Err(ApiError::new(
                ErrorKind::Server,
                "the generation panicked (a bug in klein)",
            ))
        });
        if let Ok(output) = &result {
            shared.metrics.observe_job(
                &output.timings,
                start.elapsed().as_secs_f64(),
                output.images.len(),
            );
        }
        shared.queue.running.fetch_sub(1, Ordering::SeqCst);
        // The client may be gone; its handle's drop already counted it.
        let _ = job.events.send(JobEvent::Done(result));
    }
}

/// One generation: LoRAs, references, the pipeline, the encoded images.
fn run_job(
    pipeline: &mut Pipeline,
    job: &Job,
    bundle_hash: &str,
    max_pixels: u64,
) -> Result<JobOutput, ApiError> {
    let spec = &job.spec;
    let _ = job.events.send(JobEvent::Started);
    // Unchanged LoRAs cost nothing: set_loras keeps the loaded transformer then.
    // The LoRAs are the server's own files, checked when it started: one that fails now (changed
    // since) is the server's fault, named as the client named it, never by its path.
    let loras = spec.request.loras.as_deref().unwrap_or_default();
    pipeline.set_loras(loras).map_err(|e| {
        let mut error = lora_error(&e, loras);
        error.kind = ErrorKind::Server;
        error
    })?;
    let request = pipeline
        .prepare(&spec.request)
        .map_err(|e| job_error(spec, e))?;
    // The size is known once the references are: `auto` takes the first one's.
    let (width, height) = pipeline
        .output_size(&request)
        .map_err(|e| job_error(spec, e.into()))?;
    check_pixels(width, height, request.num_images, max_pixels)?;
    let mut on_progress = |event: Progress| {
        let event = match event {
            Progress::StageStarted(stage) => JobEvent::StageStarted(stage.label()),
            Progress::StageFinished(stage, elapsed) => {
                JobEvent::StageFinished(stage.label(), elapsed.as_secs_f64())
            }
            Progress::Step { step, total } => JobEvent::Step { step, total },
            Progress::Preview(preview) => JobEvent::Preview {
                step: preview.step,
                total: preview.total,
                images: preview
                    .images
                    .iter()
                    .filter_map(|image| encode_image(image, ImageFormat::Png, &[]).ok())
                    .collect(),
            },
            _ => return ControlFlow::Continue(()),
        };
        let _ = job.events.send(event);
        if job.cancel.load(Ordering::SeqCst) {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    };
    let generation = pipeline
        .generate(&request, Some(&mut on_progress))
        .map_err(|e| match e {
            klein::KleinError::Cancelled => cancelled(),
            // A LoRA refused when merged: named as the client named it, never by its path.
            klein::KleinError::Lora { .. } => lora_error(&e, loras),
            e => job_error(spec, e.into()),
        })?;
    // The LoRAs by the names clients give, not the server's paths.
    let names = loras
        .iter()
        .map(|l| format!("{}:{}", lora_name(l.path()), l.scale()))
        .collect();
    spec.output(pipeline, &generation, bundle_hash, Some(names))
        .map_err(|e| ApiError::from_klein(&e, None))
}

/// `--max-pixels`: `num_images` images of `width` x `height` at most `max_pixels` in all.
pub(crate) fn check_pixels(
    width: u32,
    height: u32,
    num_images: usize,
    max_pixels: u64,
) -> Result<(), ApiError> {
    let pixels = u64::from(width) * u64::from(height) * num_images as u64;
    if pixels > max_pixels {
        return Err(ApiError::field(
            "size",
            format!(
                "{num_images} image(s) of {width}x{height} are {pixels} pixels; this server takes at most {max_pixels} per request (--max-pixels)"
            ),
        ));
    }
    Ok(())
}

/// `error` about `loras`, each named as clients name it (its file stem), never by its path.
fn lora_error(error: &klein::KleinError, loras: &[LoraSpec]) -> ApiError {
    let mut api = ApiError::from_klein(error, Some("loras"));
    for lora in loras {
        api.message = api
            .message
            .replace(&lora.path().display().to_string(), &lora_name(lora.path()));
    }
    api
}

/// A LoRA of `--lora-dir` by its name (the file stem), as clients name it.
pub(crate) fn lora_name(path: &Path) -> String {
    path.file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned())
}
