//! Helpers shared by the integration tests.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use klein::pipeline::{Pipeline, PipelineOptions};
use klein::runtime::{self, Device, RuntimeOptions};

/// The repository root.
pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// A file under `tests/fixtures/`.
pub fn fixture(relative: &str) -> PathBuf {
    repo().join("tests/fixtures").join(relative)
}

/// The ONNX Runtime library the tests use: `ORT_DYLIB_PATH`, else the one `scripts/setup-ort.sh`
/// installs into `<repo>/.ort/`.
pub fn ort_library() -> PathBuf {
    if let Some(path) = std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    let name = if cfg!(target_os = "macos") {
        "libonnxruntime.1.31.1.dylib"
    } else {
        "libonnxruntime.so.1.31.1"
    };
    let path = repo().join(".ort").join(name);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/setup-ort.sh first, or set ORT_DYLIB_PATH",
        path.display()
    );
    path
}

/// Initialises ONNX Runtime from [`ort_library`] (idempotent).
pub fn init_runtime() {
    runtime::init(RuntimeOptions::default().with_library(ort_library())).unwrap();
}

/// Where the tests keep verification stamps (never the user's cache directory).
pub fn test_cache_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("klein-test-cache")
}

/// The bundled tiny model (`onnx/klein-tiny`) on the CPU with one operator thread: light, and
/// bit-for-bit repeatable.
pub fn tiny_pipeline() -> Pipeline {
    Pipeline::load(&repo().join("onnx/klein-tiny"), tiny_options()).unwrap()
}

/// The options of [`tiny_pipeline`].
pub fn tiny_options() -> PipelineOptions {
    PipelineOptions::default()
        .with_device(Device::Cpu)
        .with_threads(1)
        .with_runtime(RuntimeOptions::default().with_library(ort_library()))
        .with_cache_dir(test_cache_dir())
}

/// A fresh, empty directory under Cargo's per-target temporary folder.
pub fn temp_dir(name: &str) -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}-{n}", std::process::id()));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).unwrap();
    }
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Asserts that `message` contains every one of `needles`, printing the whole message if not.
#[track_caller]
pub fn assert_mentions(message: &str, needles: &[&str]) {
    for needle in needles {
        assert!(
            message.contains(needle),
            "expected the message to mention `{needle}`; got:\n{message}"
        );
    }
}

/// Sets every file of `dir` to have been modified an hour ago: a settled bundle, which gets a
/// verification stamp (files modified within 2 s of a verification do not).
pub fn backdate(dir: &Path) {
    let past = SystemTime::now() - Duration::from_secs(3600);
    for entry in std::fs::read_dir(dir).unwrap() {
        let file = std::fs::File::options()
            .write(true)
            .open(entry.unwrap().path())
            .unwrap();
        file.set_modified(past).unwrap();
    }
}
