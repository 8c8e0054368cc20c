//! The bounded queue between the HTTP handlers and the pipelines: a job is submitted (or refused
//! with 429 when the queue is full), runs on the first free pipeline, and reports its progress
//! and result on its own channel. A job is cancelled by its handle's drop (the client went away),
//! by `DELETE /v1/klein/jobs/{id}`, or by the timeout; a cancelled job that has not started
//! leaves the queue at once (its slot is free for the next client), and one that runs stops at
//! the next step or stage.
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

pub(crate) use klein::api::{Job as JobSpec, Output as JobOutput};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::error::{ApiError, ErrorKind};
use super::metrics::Metrics;
use super::sync::lock;

/// What a job reports, in order: `Started`, stages and steps, then `Done`.
#[derive(Debug)]
pub(crate) enum JobEvent {
    Started,
    StageStarted(&'static str),
    StageFinished(&'static str, f64),
    Step {
        step: usize,
        total: usize,
    },
    /// A step preview: one PNG per image of the batch.
    Preview {
        step: usize,
        total: usize,
        images: Vec<Vec<u8>>,
    },
    Done(Result<JobOutput, ApiError>),
}

/// A queued job, as a pipeline's worker receives it.
pub(crate) struct Job {
    pub(crate) spec: JobSpec,
    pub(crate) cancel: Arc<AtomicBool>,
    pub(crate) events: UnboundedSender<JobEvent>,
    pub(crate) queued_at: Instant,
}

/// The jobs waiting for a pipeline, oldest first, and whether new ones are refused.
#[derive(Default)]
struct Waiting {
    jobs: VecDeque<Job>,
    closed: bool,
}

/// The queue, the jobs that can be cancelled by id, and the counts the metrics show.
pub(crate) struct Queue {
    waiting: Mutex<Waiting>,
    /// Signalled when a job is queued and when the queue closes.
    job_queued: Condvar,
    capacity: usize,
    /// Jobs a worker is running.
    pub(crate) running: AtomicUsize,
    workers: usize,
    next_id: AtomicU64,
    /// Randomly keyed at start: hashes the counter into job ids.
    id_hasher: std::collections::hash_map::RandomState,
    jobs: Mutex<HashMap<String, Arc<AtomicBool>>>,
    metrics: Arc<Metrics>,
}

impl Queue {
    /// A queue of `capacity` waiting jobs in front of `workers` pipelines, which take them with
    /// [`Queue::take`].
    pub(crate) fn new(capacity: usize, workers: usize, metrics: Arc<Metrics>) -> Queue {
        Queue {
            waiting: Mutex::new(Waiting::default()),
            job_queued: Condvar::new(),
            capacity,
            running: AtomicUsize::new(0),
            workers,
            next_id: AtomicU64::new(1),
            id_hasher: std::collections::hash_map::RandomState::new(),
            jobs: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    /// Queues `spec` under `id` (the client's `X-Request-Id`, else a number). Refused with 429
    /// when the queue is full, 400 (`X-Request-Id`) when the id is in use, 503 once the queue is
    /// closed.
    pub(crate) fn submit(
        self: &Arc<Self>,
        spec: JobSpec,
        id: Option<String>,
    ) -> Result<Submitted, ApiError> {
        // Ids the server makes are not guessable from one another (any client with the key may
        // cancel a job by id) and live in their own namespace (`klein-`, refused from clients).
        let id = id.unwrap_or_else(|| {
            let n = self.next_id.fetch_add(1, Ordering::Relaxed);
            format!("klein-{:016x}", self.id_hasher.hash_one(n))
        });
        // The request's log line names its job.
        let _ = super::log::JOB_ID.try_with(|slot| *lock(slot) = Some(id.clone()));
        let cancel = Arc::new(AtomicBool::new(false));
        {
            let mut jobs = lock(&self.jobs);
            if jobs.contains_key(&id) {
                return Err(ApiError {
                    param: Some("X-Request-Id".into()),
                    ..ApiError::new(
                        ErrorKind::InvalidRequest,
                        format!("request id {id} is already in use by a running request"),
                    )
                });
            }
            jobs.insert(id.clone(), cancel.clone());
        }
        let (events, receiver) = unbounded_channel();
        let mut handle = JobHandle {
            id,
            events: receiver,
            cancel: cancel.clone(),
            queue: self.clone(),
            finished: false,
        };
        let job = Job {
            spec,
            cancel,
            events,
            queued_at: Instant::now(),
        };
        let mut waiting = lock(&self.waiting);
        let refused = if waiting.closed {
            Some(ApiError::new(
                ErrorKind::Unavailable,
                "the server is shutting down",
            ))
        } else if waiting.jobs.len() >= self.capacity {
            Some(ApiError {
                retry_after: Some(self.retry_after(waiting.jobs.len())),
                ..ApiError::new(
                    ErrorKind::QueueFull,
                    format!(
                        "the queue is full ({} requests waiting for {} pipeline(s)); retry later",
                        self.capacity, self.workers
                    ),
                )
            })
        } else {
            None
        };
        if let Some(error) = refused {
            drop(waiting);
            // Never queued: nothing to cancel; the handle's drop forgets the id.
            handle.finished = true;
            return Err(error);
        }
        waiting.jobs.push_back(job);
        let position = waiting.jobs.len();
        let ahead = position - 1 + self.running.load(Ordering::SeqCst);
        drop(waiting);
        self.job_queued.notify_one();
        Ok(handle.with_position(position, ahead))
    }

    /// The oldest waiting job, once there is one; `None` once the queue is closed and empty
    /// (shutting down). Blocks the calling worker.
    pub(crate) fn take(&self) -> Option<Job> {
        let mut waiting = lock(&self.waiting);
        loop {
            if let Some(job) = waiting.jobs.pop_front() {
                return Some(job);
            }
            if waiting.closed {
                return None;
            }
            waiting = self
                .job_queued
                .wait(waiting)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }

    /// How many jobs wait for a pipeline.
    pub(crate) fn waiting(&self) -> usize {
        lock(&self.waiting).jobs.len()
    }

    /// Takes the job whose cancel flag is `cancel` out of the queue if it still waits there. The
    /// flag, not the id, names it: once a job has finished, a new request may reuse its id.
    fn remove_waiting(&self, cancel: &Arc<AtomicBool>) -> Option<Job> {
        let mut waiting = lock(&self.waiting);
        let index = (waiting.jobs.iter()).position(|job| Arc::ptr_eq(&job.cancel, cancel))?;
        waiting.jobs.remove(index)
    }

    /// Cancels the job `id`; false when no running or queued job has it. A queued one leaves
    /// the queue now, and its client gets its answer (cancelled) at once.
    pub(crate) fn cancel(&self, id: &str) -> bool {
        let Some(flag) = lock(&self.jobs).get(id).cloned() else {
            return false;
        };
        flag.store(true, Ordering::SeqCst);
        if let Some(job) = self.remove_waiting(&flag) {
            let _ = job.events.send(JobEvent::Done(Err(cancelled())));
        }
        true
    }

    /// Closes the queue: later submissions get 503; queued jobs still run.
    pub(crate) fn close(&self) {
        lock(&self.waiting).closed = true;
        self.job_queued.notify_all();
    }

    /// Seconds until a slot is likely free: the mean generation time so far times the jobs
    /// ahead (`waiting` and those running), per pipeline (at least 1).
    fn retry_after(&self, waiting: usize) -> u64 {
        let mean = self.metrics.mean_job_seconds().unwrap_or(1.0);
        let ahead =
            (waiting + self.running.load(Ordering::SeqCst)) as f64 / self.workers.max(1) as f64;
        (mean * ahead).ceil().clamp(1.0, 3600.0) as u64
    }
}

/// The answer of a job cancelled before it finished.
pub(crate) fn cancelled() -> ApiError {
    ApiError::new(ErrorKind::Cancelled, "cancelled before it finished")
}

/// A submitted job, held by the handler that waits for it. Dropping it before the job finished
/// (the client disconnected, the timeout fired) cancels the job.
pub(crate) struct JobHandle {
    pub(crate) id: String,
    pub(crate) events: UnboundedReceiver<JobEvent>,
    cancel: Arc<AtomicBool>,
    queue: Arc<Queue>,
    finished: bool,
}

/// A handle and the job's position in the queue when it was submitted (1: next), with the
/// requests before it then, waiting or running.
pub(crate) struct Submitted {
    pub(crate) handle: JobHandle,
    pub(crate) position: usize,
    pub(crate) ahead: usize,
}

impl JobHandle {
    fn with_position(self, position: usize, ahead: usize) -> Submitted {
        Submitted {
            handle: self,
            position,
            ahead,
        }
    }

    /// The next event; `Done` ends the job.
    pub(crate) async fn next(&mut self) -> Option<JobEvent> {
        let event = self.events.recv().await;
        if matches!(event, Some(JobEvent::Done(_)) | None) {
            self.finished = true;
        }
        event
    }

    /// Waits for the result, ignoring progress.
    pub(crate) async fn result(&mut self) -> Result<JobOutput, ApiError> {
        loop {
            match self.next().await {
                Some(JobEvent::Done(result)) => return result,
                Some(_) => continue,
                None => return Err(ApiError::new(ErrorKind::Server, "the pipeline stopped")),
            }
        }
    }
}

impl Drop for JobHandle {
    fn drop(&mut self) {
        if !self.finished {
            self.cancel.store(true, Ordering::SeqCst);
            self.queue.metrics.count_abandoned();
            // A job still waiting leaves the queue (and frees its uploads) now.
            drop(self.queue.remove_waiting(&self.cancel));
        }
        lock(&self.queue.jobs).remove(&self.id);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    use klein::pipeline::RequestSpec;
    use klein::stages::output::ImageFormat;

    fn spec() -> JobSpec {
        let mut request = RequestSpec::new("a fox");
        (request.width, request.height, request.steps) = (Some(64), Some(64), Some(1));
        JobSpec::new(request, ("num_images", "refs"), None, ImageFormat::Png)
    }

    fn kind(result: Result<Submitted, ApiError>) -> ErrorKind {
        result.err().map(|e| e.kind).unwrap()
    }

    /// A client that goes away, or a job cancelled by id, frees its place in the queue at once:
    /// the next client is not refused for it (it was, until a worker reached the job).
    #[test]
    fn waiting_jobs_that_are_abandoned_or_cancelled_leave_the_queue() {
        let queue = Arc::new(Queue::new(1, 1, Arc::new(Metrics::default())));
        let first = queue.submit(spec(), None).unwrap();
        assert_eq!((first.position, queue.waiting()), (1, 1));
        assert_eq!(kind(queue.submit(spec(), None)), ErrorKind::QueueFull);
        drop(first.handle);
        assert_eq!(queue.waiting(), 0, "the abandoned job left");
        let mut second = queue.submit(spec(), Some("b".into())).unwrap().handle;
        assert!(queue.cancel("b"));
        assert_eq!(queue.waiting(), 0, "the cancelled job left");
        match second.events.try_recv() {
            Ok(JobEvent::Done(Err(error))) => assert_eq!(error.kind, ErrorKind::Cancelled),
            other => panic!("the client is answered at once, not {other:?}"),
        }
        let third = queue.submit(spec(), Some("c".into())).unwrap();
        let job = queue.take().unwrap();
        assert!(
            Arc::ptr_eq(&job.cancel, &third.handle.cancel),
            "the job of c"
        );
        assert_eq!(queue.waiting(), 0);
        drop(third);
        queue.close();
        assert_eq!(kind(queue.submit(spec(), None)), ErrorKind::Unavailable);
        assert!(queue.take().is_none(), "closed and empty");
    }
}
