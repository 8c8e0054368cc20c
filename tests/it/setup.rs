//! `klein setup`: the official ONNX Runtime library installed into klein's cache (from the
//! `onnxruntime` wheel on PyPI, with pip, as `scripts/setup-ort.sh` fetches it), where a klein
//! with no repository beside it (`cargo install`) finds it (the search order is tested in
//! `src/runtime/locate.rs`); run again, it keeps what is there.
use std::process::Command;

use crate::util::temp_dir;

fn setup(cache: &std::path::Path, args: &[&str]) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_klein"))
        .arg("setup")
        .args(args)
        .env("KLEIN_CACHE_DIR", cache)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "{stderr}");
    (stdout, stderr)
}

#[test]
fn setup_installs_the_library_into_the_cache_once() {
    let cache = temp_dir("klein-setup");
    let (stdout, stderr) = setup(&cache, &[]);
    let library = std::path::PathBuf::from(stdout.trim());
    assert_eq!(
        library.parent(),
        Some(cache.join("ort").as_path()),
        "{stdout}"
    );
    assert!(library.is_file(), "{}", library.display());
    assert!(
        stderr.contains("installed ONNX Runtime 1.31.1"),
        "the library it installed loads and says its release: {stderr}"
    );
    let (again, stderr) = setup(&cache, &[]);
    assert_eq!(again, stdout);
    assert!(stderr.contains("already installed"), "{stderr}");
    std::fs::remove_dir_all(&cache).unwrap();
}
