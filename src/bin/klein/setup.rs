//! `klein setup`: installs the official ONNX Runtime library into klein's cache
//! (`<cache dir>/ort/`, where every klein finds it), from the `onnxruntime` wheel on PyPI, fetched
//! with `python3 -m pip` and unpacked as `scripts/setup-ort.sh` does. For a `klein` installed
//! with `cargo install`, which has no repository `.ort/` beside it.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use klein::runtime::{library_in_dir, RuntimeOptions, SETUP_DIR};

use crate::args::SetupArgs;
use crate::UsageError;

/// The release installed: the one `ort`'s `api-31` feature needs (keep in step with
/// scripts/setup-ort.sh).
const ORT_VERSION: &str = "1.31.1";
/// Every onnxruntime wheel carries the same library; asking for one Python version lets any
/// `python3` that runs pip fetch it.
const WHEEL_PYTHON: &str = "3.11";

/// Unpacks `onnxruntime/capi/libonnxruntime*` of the wheel (argv[1]) flat into argv[2].
const UNPACK: &str = r#"
import os, sys, zipfile
wheel, stage = sys.argv[1], sys.argv[2]
prefix = "onnxruntime/capi/libonnxruntime"
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.startswith(prefix)]
    if not members:
        sys.exit(f"no {prefix}* in {wheel}")
    for m in members:
        with z.open(m) as src, open(os.path.join(stage, os.path.basename(m)), "wb") as dst:
            dst.write(src.read())
"#;

pub(crate) fn setup(args: SetupArgs) -> anyhow::Result<()> {
    let cache = klein::fsutil::default_cache_dir().ok_or_else(|| {
        UsageError("klein has no cache directory: set KLEIN_CACHE_DIR (or HOME)".into())
    })?;
    let dest = cache.join(SETUP_DIR);
    if let Some(found) = library_in_dir(&dest).filter(|_| !args.force) {
        eprintln!(
            "klein setup: ONNX Runtime is already installed in {} (--force installs it again)",
            dest.display()
        );
        println!("{}", found.display());
        return Ok(());
    }
    std::fs::create_dir_all(&dest).with_context(|| format!("creating {}", dest.display()))?;
    // Staged inside the destination, so that the final moves are renames on one file system: an
    // interrupted run never leaves a half-written library under its real name.
    let stage = dest.join(format!(".stage-{}", std::process::id()));
    let installed = install(&stage, &dest);
    let _ = std::fs::remove_dir_all(&stage);
    let library = installed?;
    let info = klein::runtime::init(RuntimeOptions::default().with_library(&library))
        .context("the installed library does not load")?;
    let version = info.version.map_or("unknown".into(), |v| v.to_string());
    eprintln!(
        "klein setup: installed ONNX Runtime {version} (the official onnxruntime=={ORT_VERSION} wheel) in {}",
        dest.display()
    );
    println!("{}", library.display());
    Ok(())
}

/// Fetches the wheel into `stage`, unpacks its library there, and moves it into `dest`.
fn install(stage: &Path, dest: &Path) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(stage)?;
    eprintln!("klein setup: fetching onnxruntime=={ORT_VERSION} from PyPI with pip");
    let wheels = stage.join("wheel");
    run(Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
        ])
        .args(["--python-version", WHEEL_PYTHON, "--dest"])
        .arg(&wheels)
        .arg(format!("onnxruntime=={ORT_VERSION}")))?;
    let wheel = std::fs::read_dir(&wheels)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .context("pip fetched no onnxruntime wheel")?;
    let unpacked = stage.join("lib");
    std::fs::create_dir_all(&unpacked)?;
    run(Command::new("python3")
        .args(["-c", UNPACK])
        .arg(&wheel)
        .arg(&unpacked))?;
    let main = library_in_dir(&unpacked).context("the wheel holds no ONNX Runtime library")?;
    // The main library last: its presence marks the install as complete.
    for entry in std::fs::read_dir(&unpacked)? {
        let path = entry?.path();
        if path != main {
            std::fs::rename(&path, dest.join(path.file_name().unwrap_or_default()))?;
        }
    }
    let target = dest.join(main.file_name().unwrap_or_default());
    std::fs::rename(&main, &target)?;
    Ok(target)
}

/// Runs `command` (python3 and pip), its failure named.
fn run(command: &mut Command) -> anyhow::Result<()> {
    let status = command.status().with_context(|| {
        "running python3: klein setup fetches the library with pip (python3 -m pip); install \
         python3 with pip, or set ORT_DYLIB_PATH to an ONNX Runtime library"
    })?;
    anyhow::ensure!(status.success(), "{command:?} failed ({status})");
    Ok(())
}
