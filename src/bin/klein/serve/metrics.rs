//! `GET /metrics` in the Prometheus text format: queue depth, requests by route and status,
//! errors by kind, latency histograms per route and per pipeline stage, queue wait.
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use super::sync::lock;

/// Histogram bucket bounds in seconds: a 64x64 image on the tiny model takes ~0.1 s, a 1024x1024
/// one on the 4B on a CPU some minutes.
const BUCKETS: [f64; 14] = [
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
];

#[derive(Debug, Clone, Default)]
struct Histogram {
    /// Observations at or below each bound of [`BUCKETS`] (not cumulative).
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    fn observe(&mut self, seconds: f64) {
        if let Some(i) = BUCKETS.iter().position(|&b| seconds <= b) {
            self.counts[i] += 1;
        }
        self.count += 1;
        self.sum += seconds;
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (bound, n) in BUCKETS.iter().zip(self.counts) {
            cumulative += n;
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {cumulative}"
            );
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.count
        );
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {}", self.count);
    }
}

/// Every figure `/metrics` shows, updated by the handlers and the workers.
#[derive(Default)]
pub(crate) struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    errors: Mutex<BTreeMap<&'static str, u64>>,
    request_seconds: Mutex<BTreeMap<String, Histogram>>,
    stage_seconds: Mutex<BTreeMap<&'static str, Histogram>>,
    queue_wait: Mutex<Histogram>,
    job_seconds: Mutex<Histogram>,
    images: AtomicU64,
    abandoned: AtomicU64,
    /// Generations each pipeline ran (by its index: the order of `--device`).
    pipeline_jobs: Mutex<BTreeMap<usize, u64>>,
}

/// Gauges read from the queue when `/metrics` is rendered.
pub(crate) struct Gauges {
    pub(crate) waiting: usize,
    pub(crate) running: usize,
    pub(crate) pipelines: usize,
    pub(crate) ready: bool,
}

impl Metrics {
    /// A finished HTTP request: its route (the pattern, not the path), status and duration.
    pub(crate) fn count_request(&self, route: &str, status: u16, seconds: f64) {
        *lock(&self.requests)
            .entry((route.to_string(), status))
            .or_default() += 1;
        lock(&self.request_seconds)
            .entry(route.to_string())
            .or_default()
            .observe(seconds);
    }

    pub(crate) fn count_error(&self, kind: &'static str) {
        *lock(&self.errors).entry(kind).or_default() += 1;
    }

    /// A job whose client went away (disconnected, timed out) before it finished.
    pub(crate) fn count_abandoned(&self) {
        self.abandoned.fetch_add(1, Ordering::Relaxed);
    }

    /// A job taken by a worker after `seconds` in the queue.
    pub(crate) fn observe_queue_wait(&self, seconds: f64) {
        lock(&self.queue_wait).observe(seconds);
    }

    /// A finished generation: its stages and total time, and its images.
    pub(crate) fn observe_job(&self, stages: &[(&'static str, f64)], seconds: f64, images: usize) {
        let mut histograms = lock(&self.stage_seconds);
        for &(stage, s) in stages {
            histograms.entry(stage).or_default().observe(s);
        }
        lock(&self.job_seconds).observe(seconds);
        self.images.fetch_add(images as u64, Ordering::Relaxed);
    }

    /// A job pipeline `index` took.
    pub(crate) fn count_pipeline_job(&self, index: usize) {
        *lock(&self.pipeline_jobs).entry(index).or_default() += 1;
    }

    /// Mean seconds of a generation so far (for Retry-After).
    pub(crate) fn mean_job_seconds(&self) -> Option<f64> {
        let h = lock(&self.job_seconds);
        (h.count > 0).then(|| h.sum / h.count as f64)
    }

    pub(crate) fn render(&self, gauges: &Gauges) -> String {
        let mut out = String::new();
        let gauge = |out: &mut String, name: &str, help: &str, value: f64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
            );
        };
        gauge(
            &mut out,
            "klein_queue_depth",
            "Requests waiting for a pipeline.",
            gauges.waiting as f64,
        );
        gauge(
            &mut out,
            "klein_jobs_running",
            "Generations running.",
            gauges.running as f64,
        );
        gauge(
            &mut out,
            "klein_pipelines",
            "Loaded pipelines (one per device).",
            gauges.pipelines as f64,
        );
        gauge(
            &mut out,
            "klein_ready",
            "1 when every pipeline is loaded and the server takes work.",
            f64::from(u8::from(gauges.ready)),
        );

        let _ = writeln!(out, "# HELP klein_requests_total HTTP requests by route and status.\n# TYPE klein_requests_total counter");
        for ((route, status), n) in lock(&self.requests).iter() {
            let _ = writeln!(
                out,
                "klein_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP klein_errors_total Error responses by kind.\n# TYPE klein_errors_total counter"
        );
        for (kind, n) in lock(&self.errors).iter() {
            let _ = writeln!(out, "klein_errors_total{{kind=\"{kind}\"}} {n}");
        }
        let _ = writeln!(out, "# HELP klein_abandoned_total Generations cancelled because their client went away or timed out.\n# TYPE klein_abandoned_total counter\nklein_abandoned_total {}", self.abandoned.load(Ordering::Relaxed));
        let _ = writeln!(out, "# HELP klein_pipeline_jobs_total Jobs each pipeline ran (the order of --device).\n# TYPE klein_pipeline_jobs_total counter");
        for (index, n) in lock(&self.pipeline_jobs).iter() {
            let _ = writeln!(out, "klein_pipeline_jobs_total{{pipeline=\"{index}\"}} {n}");
        }
        let _ = writeln!(out, "# HELP klein_images_total Images generated.\n# TYPE klein_images_total counter\nklein_images_total {}", self.images.load(Ordering::Relaxed));

        let _ = writeln!(out, "# HELP klein_request_seconds HTTP request latency by route.\n# TYPE klein_request_seconds histogram");
        for (route, h) in lock(&self.request_seconds).iter() {
            h.render(
                &mut out,
                "klein_request_seconds",
                &format!("route=\"{route}\""),
            );
        }
        let _ = writeln!(out, "# HELP klein_stage_seconds Time per pipeline stage.\n# TYPE klein_stage_seconds histogram");
        for (stage, h) in lock(&self.stage_seconds).iter() {
            h.render(
                &mut out,
                "klein_stage_seconds",
                &format!("stage=\"{stage}\""),
            );
        }
        let _ = writeln!(out, "# HELP klein_queue_wait_seconds Time a request waited for a pipeline.\n# TYPE klein_queue_wait_seconds histogram");
        lock(&self.queue_wait).render(&mut out, "klein_queue_wait_seconds", "");
        let _ = writeln!(out, "# HELP klein_generation_seconds Time of a whole generation on a pipeline.\n# TYPE klein_generation_seconds histogram");
        lock(&self.job_seconds).render(&mut out, "klein_generation_seconds", "");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histograms_are_cumulative_with_sum_and_count() {
        let metrics = Metrics::default();
        metrics.observe_job(&[("denoise", 0.3), ("decode", 0.07)], 0.4, 2);
        metrics.observe_job(&[("denoise", 4000.0)], 4000.0, 1);
        let text = metrics.render(&Gauges {
            waiting: 3,
            running: 1,
            pipelines: 1,
            ready: true,
        });
        assert!(text.contains("klein_queue_depth 3\n"), "{text}");
        assert!(text.contains("klein_stage_seconds_bucket{stage=\"denoise\",le=\"0.25\"} 0\n"));
        assert!(text.contains("klein_stage_seconds_bucket{stage=\"denoise\",le=\"0.5\"} 1\n"));
        assert!(text.contains("klein_stage_seconds_bucket{stage=\"denoise\",le=\"1800\"} 1\n"));
        assert!(text.contains("klein_stage_seconds_bucket{stage=\"denoise\",le=\"+Inf\"} 2\n"));
        assert!(text.contains("klein_stage_seconds_count{stage=\"denoise\"} 2\n"));
        assert!(text.contains("klein_images_total 3\n"));
        assert_eq!(metrics.mean_job_seconds(), Some(2000.2));
    }
}
