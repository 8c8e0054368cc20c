//! Finding and loading the ONNX Runtime library. Loading happens once per process, so this is its
//! own test binary with a single test that walks through the cases in order.

use std::path::{Path, PathBuf};

use klein::runtime::{self, LibrarySource, RuntimeOptions};
use klein::KleinError;

fn library_error(result: klein::Result<impl std::fmt::Debug>) -> String {
    match result {
        Err(KleinError::RuntimeLibrary(message)) => message,
        other => panic!("expected a runtime-library error, got {other:?}"),
    }
}

#[track_caller]
fn assert_mentions(message: &str, needles: &[&str]) {
    for needle in needles {
        assert!(
            message.contains(needle),
            "expected `{needle}` in:\n{message}"
        );
    }
}

fn good_library() -> PathBuf {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    match std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        Some(p) => PathBuf::from(p),
        None if cfg!(target_os = "macos") => repo.join(".ort/libonnxruntime.1.31.1.dylib"),
        None => repo.join(".ort/libonnxruntime.so.1.31.1"),
    }
}

#[test]
fn library_discovery_and_loading() {
    let good = good_library();
    assert!(
        good.is_file(),
        "{} is missing: run scripts/setup-ort.sh first",
        good.display()
    );
    let how_to = ["ORT_DYLIB_PATH", "klein setup", "scripts/setup-ort.sh"];

    // ORT_DYLIB_PATH pointing nowhere is an error, not a reason to look elsewhere. This binary runs
    // one test, so changing the environment races with nothing.
    let saved = std::env::var_os("ORT_DYLIB_PATH");
    std::env::set_var("ORT_DYLIB_PATH", "/nonexistent/libonnxruntime.so");
    let message = library_error(runtime::locate_library(None));
    assert_mentions(
        &message,
        &[
            "/nonexistent/libonnxruntime.so",
            "value of ORT_DYLIB_PATH",
            "does not exist",
        ],
    );
    assert_mentions(&message, &how_to);
    std::env::set_var("ORT_DYLIB_PATH", &good);
    assert_eq!(
        runtime::locate_library(None).unwrap(),
        (good.clone(), LibrarySource::EnvVar)
    );
    // Without it: the path baked in at build time (KLEIN_ORT_DYLIB), else the executable's folder
    // and <exe>/../../.ort, which for a test binary (target/debug/deps/) hold no library.
    std::env::remove_var("ORT_DYLIB_PATH");
    match option_env!("KLEIN_ORT_DYLIB").filter(|p| !p.is_empty() && Path::new(p).is_file()) {
        Some(baked) => assert_eq!(
            runtime::locate_library(None).unwrap(),
            (PathBuf::from(baked), LibrarySource::BuildTime)
        ),
        None => {
            let message = library_error(runtime::locate_library(None));
            assert_mentions(&message, &["no ONNX Runtime library found", "target"]);
            assert_mentions(&message, &how_to);
        }
    }
    if let Some(v) = saved {
        std::env::set_var("ORT_DYLIB_PATH", v);
    }

    // An explicit path wins over everything.
    assert_eq!(
        runtime::locate_library(Some(&good)).unwrap(),
        (good.clone(), LibrarySource::Explicit)
    );

    // A missing explicit file.
    let message = library_error(runtime::init(
        RuntimeOptions::default().with_library("/nonexistent/libort.so"),
    ));
    assert_mentions(
        &message,
        &["/nonexistent/libort.so (given explicitly) does not exist"],
    );
    assert_mentions(&message, &how_to);

    // A file that is not a library: ort reports the dlopen failure, nothing panics.
    let not_a_library =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/graphs/affine.onnx");
    let message = library_error(runtime::init(
        RuntimeOptions::default().with_library(&not_a_library),
    ));
    assert_mentions(
        &message,
        &["affine.onnx (given explicitly) could not be loaded"],
    );
    assert_mentions(&message, &how_to);
    assert!(runtime::runtime_info().is_none());

    // The real library loads, once; later calls report it.
    let info = runtime::init(RuntimeOptions::default().with_library(&good)).unwrap();
    assert_eq!(info.library, std::path::absolute(&good).unwrap());
    assert_eq!(info.source, LibrarySource::Explicit);
    assert_eq!(runtime::init(RuntimeOptions::default()).unwrap(), info);
    assert_eq!(runtime::runtime_info(), Some(info));

    // Switching libraries within a process is refused.
    let message = library_error(runtime::init(
        RuntimeOptions::default().with_library(&not_a_library),
    ));
    assert_mentions(&message, &["already loaded from", "cannot switch"]);
}
