//! The `klein` binary end to end on the bundled tiny model (`onnx/klein-tiny/`): what it writes and
//! prints on success, and, for every kind of bad input, a clear error on stderr, exit code 2, no
//! panic and no output file (nor a temporary one).
//!
//! Sizes are 64x64 with 2 steps (well under a second a run); the bundle's default 1024x1024 runs
//! once. Broken bundles are copies of the tiny bundle in a temporary directory, never the bundle.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::util::{assert_mentions, backdate, ort_library, repo, temp_dir, test_cache_dir};

/// Fast generation flags: 64x64 pixels (4x4 latents), 2 steps.
pub(crate) const FAST: [&str; 6] = ["--width", "64", "--height", "64", "--steps", "2"];

pub(crate) fn bundle_dir() -> PathBuf {
    repo().join("onnx/klein-tiny")
}

/// What one run of the binary did.
pub(crate) struct Run {
    pub(crate) args: Vec<String>,
    pub(crate) code: Option<i32>,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

impl Run {
    pub(crate) fn describe(&self) -> String {
        format!(
            "klein {}\nexit code: {:?}\n--- stdout ---\n{}--- stderr ---\n{}",
            self.args.join(" "),
            self.code,
            self.stdout,
            self.stderr
        )
    }

    /// Exit 0, no panic, the output paths (and nothing else) on stdout.
    #[track_caller]
    pub(crate) fn assert_success(&self, outputs: &[&Path]) {
        assert_eq!(self.code, Some(0), "expected success:\n{}", self.describe());
        assert!(!self.stderr.contains("panicked"), "{}", self.describe());
        let expected: String = outputs
            .iter()
            .map(|p| format!("{}\n", p.display()))
            .collect();
        assert_eq!(
            self.stdout,
            expected,
            "stdout should list the outputs:\n{}",
            self.describe()
        );
        for path in outputs {
            assert!(
                path.is_file(),
                "{} was not written:\n{}",
                path.display(),
                self.describe()
            );
        }
    }

    /// Exit 2 (a user error), no panic, nothing on stdout, and an error on stderr that mentions
    /// every one of `needles`.
    #[track_caller]
    pub(crate) fn assert_user_error(&self, needles: &[&str]) {
        assert_eq!(
            self.code,
            Some(2),
            "expected exit code 2:\n{}",
            self.describe()
        );
        assert!(
            !self.stderr.contains("panicked"),
            "the binary panicked:\n{}",
            self.describe()
        );
        assert!(
            self.stdout.is_empty(),
            "nothing should be on stdout:\n{}",
            self.describe()
        );
        assert!(
            self.stderr.contains("error"),
            "no error on stderr:\n{}",
            self.describe()
        );
        assert_mentions(&self.stderr, needles);
    }
}

/// Runs the binary with the tests' ONNX Runtime library, the tests' cache directory and no
/// `KLEIN_MODEL` (so that the bundled tiny model is the default).
pub(crate) fn klein<S: AsRef<OsStr>>(args: impl IntoIterator<Item = S>) -> Run {
    let cache = test_cache_dir();
    klein_env(args, &[("KLEIN_CACHE_DIR", Some(cache.as_os_str()))])
}

/// `klein <args>` started, then sent SIGINT once `ready` says so (polled every 50 ms, for at most
/// 120 s); its exit within 30 s of the signal, with its stderr.
#[cfg(unix)]
pub(crate) fn interrupted_klein<S: AsRef<OsStr>>(
    args: impl IntoIterator<Item = S>,
    ready: impl Fn() -> bool,
) -> std::process::Output {
    use std::process::Stdio;
    use std::time::{Duration, Instant};
    let child = Command::new(env!("CARGO_BIN_EXE_klein"))
        .args(args)
        .env("ORT_DYLIB_PATH", ort_library())
        .env("KLEIN_CACHE_DIR", test_cache_dir())
        .env_remove("KLEIN_MODEL")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !ready() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "never ready to interrupt"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let signalled = Instant::now();
    let output = child.wait_with_output().unwrap();
    assert!(signalled.elapsed() < Duration::from_secs(30));
    output
}

/// [`klein`] with environment variables set (`Some`) or removed (`None`).
pub(crate) fn klein_env<S: AsRef<OsStr>>(
    args: impl IntoIterator<Item = S>,
    env: &[(&str, Option<&OsStr>)],
) -> Run {
    let args: Vec<_> = args
        .into_iter()
        .map(|a| a.as_ref().to_os_string())
        .collect();
    let mut command = Command::new(env!("CARGO_BIN_EXE_klein"));
    command
        .args(&args)
        .env("ORT_DYLIB_PATH", ort_library())
        .env_remove("KLEIN_MODEL");
    for (name, value) in env {
        match value {
            Some(value) => command.env(name, value),
            None => command.env_remove(name),
        };
    }
    let output = command.output().unwrap();
    Run {
        args: args
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect(),
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// `klein generate <prompt> -o <output> <extra...>`.
pub(crate) fn generate(prompt: &str, output: &Path, extra: &[&str]) -> Run {
    let mut args: Vec<&OsStr> = vec![
        "generate".as_ref(),
        prompt.as_ref(),
        "-o".as_ref(),
        output.as_ref(),
    ];
    args.extend(extra.iter().map(OsStr::new));
    klein(args)
}

/// A generation that must fail with a user error: it writes to an empty directory, and that
/// directory must still be empty afterwards (no output, no temporary file).
#[track_caller]
pub(crate) fn assert_refused(extra: &[&str], needles: &[&str]) -> Run {
    let out_dir = temp_dir("cli-refused");
    let run = generate("a cat", &out_dir.join("out.png"), extra);
    run.assert_user_error(needles);
    assert_eq!(
        files_in(&out_dir),
        Vec::<String>::new(),
        "files left behind:\n{}",
        run.describe()
    );
    run
}

pub(crate) fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// A decoded output PNG: its pixels and its iTXt metadata.
pub(crate) struct Png {
    pub(crate) width: u32,
    pub(crate) height: u32,
    pub(crate) pixels: Vec<u8>,
    pub(crate) text: BTreeMap<String, String>,
}

pub(crate) fn read_png(path: &Path) -> Png {
    let file = std::fs::File::open(path).unwrap();
    let mut reader = png::Decoder::new(std::io::BufReader::new(file))
        .read_info()
        .unwrap();
    let text = reader
        .info()
        .utf8_text
        .iter()
        .map(|chunk| (chunk.keyword.clone(), chunk.get_text().unwrap()))
        .collect();
    let mut pixels = vec![0; reader.output_buffer_size().unwrap()];
    let frame = reader.next_frame(&mut pixels).unwrap();
    assert_eq!(
        (frame.color_type, frame.bit_depth),
        (png::ColorType::Rgb, png::BitDepth::Eight)
    );
    pixels.truncate(frame.buffer_size());
    Png {
        width: frame.width,
        height: frame.height,
        pixels,
        text,
    }
}

/// Compares two images' pixels, tolerance 0; on failure prints how many bytes differ and where.
#[track_caller]
fn assert_same_pixels(what: &str, expected: &Png, got: &Png) {
    assert_eq!(
        (expected.width, expected.height),
        (got.width, got.height),
        "{what}: size"
    );
    let diffs: Vec<usize> = (0..expected.pixels.len())
        .filter(|&i| expected.pixels[i] != got.pixels[i])
        .collect();
    assert!(
        diffs.is_empty(),
        "{what}: {} of {} bytes differ; first (index, expected, got): {:?}",
        diffs.len(),
        expected.pixels.len(),
        diffs
            .iter()
            .take(8)
            .map(|&i| (i, expected.pixels[i], got.pixels[i]))
            .collect::<Vec<_>>()
    );
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The seed from the `seed: N` line on stderr.
fn printed_seed(run: &Run) -> u64 {
    let line = run.stderr.lines().find_map(|l| l.strip_prefix("seed: "));
    line.and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("no `seed: N` on stderr:\n{}", run.describe()))
}

/// A solid-colour RGB PNG of `width x height` at `path`.
pub(crate) fn solid_png(path: &Path, width: u32, height: u32) -> PathBuf {
    image::RgbImage::from_pixel(width, height, image::Rgb([200, 80, 40]))
        .save(path)
        .unwrap();
    path.to_path_buf()
}

/// A copy of the tiny bundle (about 20 MB) in a fresh directory, to break. Removed when dropped,
/// unless the test failed (to look at).
pub(crate) struct BundleCopy(PathBuf);

impl BundleCopy {
    pub(crate) fn new(name: &str) -> Self {
        let dir = temp_dir(name);
        for entry in std::fs::read_dir(bundle_dir()).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
        }
        BundleCopy(dir)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }

    pub(crate) fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    pub(crate) fn arg(&self) -> &str {
        path_str(&self.0)
    }
}

impl Drop for BundleCopy {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Replaces `file` with garbage bytes of the same size (so only a hash check or the loader can tell).
pub(crate) fn corrupt(file: &Path) {
    let size = std::fs::metadata(file).unwrap().len() as usize;
    let garbage: Vec<u8> = (0..size)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(file, garbage).unwrap();
}

/// Edits the copied bundle's manifest.json as JSON.
pub(crate) fn edit_manifest(bundle: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = bundle.join("manifest.json");
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut manifest);
    std::fs::write(&path, serde_json::to_vec_pretty(&manifest).unwrap()).unwrap();
}

pub(crate) fn path_str(path: &Path) -> &str {
    path.to_str().unwrap()
}

// ---- success ----

/// Writes the PNG, prints its path on stdout, and records prompt, seed, steps, size, variant,
/// bundle hash (sha256 of manifest.json), device and references as iTXt.
#[test]
fn generate_writes_a_png_with_its_settings() {
    let dir = temp_dir("cli-generate");
    let out = dir.join("out.png");
    let run = generate(
        "a red fox in the snow",
        &out,
        &[&FAST[..], &["--seed", "7"]].concat(),
    );
    run.assert_success(&[&out]);
    assert_mentions(&run.stderr, &["seed: 7", "device: cpu"]);
    let png = read_png(&out);
    assert_eq!((png.width, png.height), (64, 64));
    let manifest = std::fs::read(bundle_dir().join("manifest.json")).unwrap();
    let expected: BTreeMap<&str, String> = [
        ("prompt", "a red fox in the snow".to_string()),
        ("seed", "7".to_string()),
        ("steps", "2".to_string()),
        ("size", "64x64".to_string()),
        ("model_variant", "tiny".to_string()),
        ("bundle_sha256", sha256_hex(&manifest)),
        ("device", "cpu".to_string()),
        ("references", "[]".to_string()),
    ]
    .into_iter()
    .collect();
    for (key, value) in &expected {
        assert_eq!(
            png.text.get(*key),
            Some(value),
            "iTXt `{key}`; all text chunks: {:?}",
            png.text
        );
    }
    assert_eq!(files_in(&dir), ["out.png"], "no temporary file is left");
}

/// A side that is not a multiple of 16 is floored, as diffusers floors it, and the warning says
/// so; sides that are multiples give no such warning.
#[test]
fn a_size_floored_to_16_is_a_warning() {
    let dir = temp_dir("cli-floor");
    let out = dir.join("out.png");
    let run = generate(
        "a red fox in the snow",
        &out,
        &[
            "--steps", "1", "--width", "100", "--height", "64", "--seed", "3",
        ],
    );
    run.assert_success(&[&out]);
    let png = read_png(&out);
    assert_eq!((png.width, png.height), (96, 64));
    assert_mentions(
        &run.stderr,
        &["klein: warning: width 100 is floored to 96: image sides are multiples of 16"],
    );
    let run = generate(
        "a red fox in the snow",
        &out,
        &[
            "--steps", "1", "--width", "96", "--height", "64", "--seed", "3",
        ],
    );
    run.assert_success(&[&out]);
    assert!(!run.stderr.contains("floored"), "{}", run.stderr);
}

/// The same seed gives byte-identical pixels; another seed gives other pixels.
#[test]
fn same_seed_same_pixels_other_seed_other_pixels() {
    let dir = temp_dir("cli-seed");
    let (a, b, c) = (dir.join("a.png"), dir.join("b.png"), dir.join("c.png"));
    for (out, seed) in [(&a, "42"), (&b, "42"), (&c, "43")] {
        generate(
            "a lighthouse",
            out,
            &[&FAST[..], &["--seed", seed]].concat(),
        )
        .assert_success(&[out]);
    }
    assert_same_pixels("seed 42 twice", &read_png(&a), &read_png(&b));
    assert_ne!(
        read_png(&a).pixels,
        read_png(&c).pixels,
        "seeds 42 and 43 gave the same image"
    );
}

/// Without --seed a random seed is used, printed as `seed: N` and stored; it reproduces the image.
/// It is below 2^53, so that JSON readers whose numbers are doubles keep it exact.
#[test]
fn random_seed_is_printed_and_reproduces_the_image() {
    let dir = temp_dir("cli-random-seed");
    let (first, again) = (dir.join("first.png"), dir.join("again.png"));
    let run = generate("a lighthouse", &first, &FAST);
    run.assert_success(&[&first]);
    let seed = printed_seed(&run);
    assert!(seed < 1 << 53, "random seed {seed} is not below 2^53");
    let png = read_png(&first);
    assert_eq!(png.text.get("seed"), Some(&seed.to_string()), "stored seed");
    generate(
        "a lighthouse",
        &again,
        &[&FAST[..], &["--seed", &seed.to_string()]].concat(),
    )
    .assert_success(&[&again]);
    assert_same_pixels(
        "random seed, then the printed seed",
        &png,
        &read_png(&again),
    );
}

/// `--num-images 2` writes NAME-1.png and NAME-2.png. As in diffusers, the whole batch's noise comes
/// from one generator, and torch's randn fills 16 values at a time, so the first 128*h*w normals
/// of the batch are the single image's: image 1 equals the single image of the same seed
/// (tolerance 0; the tiny graphs treat batch rows independently).
#[test]
fn batch_writes_numbered_files_and_its_first_image_is_the_single_image() {
    let dir = temp_dir("cli-batch");
    let single = dir.join("single.png");
    generate(
        "two birds",
        &single,
        &[&FAST[..], &["--seed", "5"]].concat(),
    )
    .assert_success(&[&single]);
    let batch = dir.join("out.png");
    let (one, two) = (dir.join("out-1.png"), dir.join("out-2.png"));
    generate(
        "two birds",
        &batch,
        &[&FAST[..], &["--seed", "5", "--num-images", "2"]].concat(),
    )
    .assert_success(&[&one, &two]);
    assert!(!batch.exists(), "a batch writes only numbered files");
    assert_same_pixels(
        "batch image 1 vs the single image",
        &read_png(&single),
        &read_png(&one),
    );
    assert_ne!(
        read_png(&one).pixels,
        read_png(&two).pixels,
        "the two images of a batch are the same"
    );
    assert_eq!(read_png(&two).text.get("seed"), Some(&"5".to_string()));
}

/// The bundle's defaults (1024x1024, 4 steps) when no size or steps are given; `--timings` prints
/// the time of every stage. The only run at the default size.
#[test]
fn defaults_come_from_the_bundle_and_timings_are_printed() {
    let dir = temp_dir("cli-defaults");
    let out = dir.join("out.png");
    let run = generate("a city at night", &out, &["--seed", "1", "--timings"]);
    run.assert_success(&[&out]);
    let png = read_png(&out);
    assert_eq!((png.width, png.height), (1024, 1024));
    assert_eq!(png.text.get("steps"), Some(&"4".to_string()));
    for stage in [
        "load text encoder",
        "encode prompt",
        "load transformer",
        "denoise",
        "load VAE decoder",
        "decode",
    ] {
        let line = run
            .stderr
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{stage}:")));
        assert!(
            line.is_some_and(|l| l.trim_end().ends_with(" s")),
            "no timing for `{stage}`:\n{}",
            run.describe()
        );
    }
    // Where each graph ran (the text encoder, released before the transformer loads, included).
    for graph in ["text_encoder", "transformer", "vae_decoder"] {
        assert_mentions(&run.stderr, &[&format!("{graph}: runs on cpu")]);
    }
}

#[test]
fn quiet_prints_nothing_on_stderr() {
    let out = temp_dir("cli-quiet").join("out.png");
    let run = generate("a cat", &out, &[&FAST[..], &["--quiet"]].concat());
    run.assert_success(&[&out]);
    assert_eq!(run.stderr, "", "--quiet:\n{}", run.describe());
}

#[test]
fn empty_prompt_is_allowed() {
    let out = temp_dir("cli-empty-prompt").join("out.png");
    generate("", &out, &FAST).assert_success(&[&out]);
    assert_eq!(read_png(&out).text.get("prompt"), Some(&String::new()));
}

/// A prompt over 512 tokens is cut as the reference pipeline does, with a warning, and succeeds.
#[test]
fn long_prompt_is_truncated_with_a_warning() {
    let out = temp_dir("cli-long-prompt").join("out.png");
    let prompt = vec!["word"; 3000].join(" ");
    let run = generate(&prompt, &out, &[&FAST[..], &["--quiet"]].concat());
    run.assert_success(&[&out]);
    assert_mentions(&run.stderr, &["warning", "truncated", "512 tokens"]);
    assert_eq!(
        read_png(&out).text.get("prompt"),
        Some(&prompt),
        "the full prompt is stored"
    );
}

/// With a reference and no size, the output takes the reference's size; the reference is recorded.
#[test]
fn reference_sets_the_size_and_is_recorded() {
    let dir = temp_dir("cli-reference");
    let reference = solid_png(&dir.join("ref.png"), 96, 64);
    let out = dir.join("out.png");
    let run = generate(
        "make it blue",
        &out,
        &["--ref", path_str(&reference), "--steps", "2", "--seed", "3"],
    );
    run.assert_success(&[&out]);
    let png = read_png(&out);
    assert_eq!((png.width, png.height), (96, 64));
    assert_eq!(
        png.text.get("references"),
        Some(&serde_json::to_string(&[path_str(&reference)]).unwrap())
    );
}

/// A reference that can be read only once (a pipe: here stdin, as a shell's `<(...)` gives
/// `/dev/fd/N`) makes the image the same file makes.
#[cfg(unix)]
#[test]
fn a_reference_from_a_pipe_is_read_once() {
    use std::io::Write;
    use std::process::Stdio;
    let dir = temp_dir("cli-reference-pipe");
    let reference = solid_png(&dir.join("ref.png"), 96, 64);
    let (from_file, from_pipe) = (dir.join("file.png"), dir.join("pipe.png"));
    let args = ["--steps", "2", "--seed", "3"];
    generate(
        "make it blue",
        &from_file,
        &[&args[..], &["--ref", path_str(&reference)]].concat(),
    )
    .assert_success(&[&from_file]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_klein"))
        .args(["generate", "make it blue", "--ref", "/dev/stdin", "-o"])
        .arg(&from_pipe)
        .args(args)
        .env("ORT_DYLIB_PATH", ort_library())
        .env("KLEIN_CACHE_DIR", test_cache_dir())
        .env_remove("KLEIN_MODEL")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let bytes = std::fs::read(&reference).unwrap();
    child.stdin.take().unwrap().write_all(&bytes).unwrap(); // dropped: the pipe closes
    let done = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert_eq!(done.status.code(), Some(0), "{stderr}");
    let pixels = |path: &Path| image::open(path).unwrap().to_rgb8().into_raw();
    assert_eq!(pixels(&from_pipe), pixels(&from_file));
}

/// What a bundle was exported from beyond its checkpoint: a single-file transformer and LoRAs
/// merged at export (manifest `model.transformer_file`, `model.loras`), shown by `klein info`.
#[test]
fn info_names_the_files_merged_at_export() {
    let bundle = BundleCopy::new("cli-info-sources");
    let path = bundle.file("manifest.json");
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    manifest["model"]["transformer_file"] =
        serde_json::json!({"file": "finetune.safetensors", "sha256": "ab12"});
    manifest["model"]["loras"] =
        serde_json::json!([{"file": "style.safetensors", "sha256": "cd34", "scale": 0.8}]);
    std::fs::write(&path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    let run = klein(["info", bundle.arg()]);
    assert_eq!(run.code, Some(0), "{}", run.describe());
    assert_mentions(
        &run.stdout,
        &[
            "weights:      transformer from finetune.safetensors (sha256 ab12)",
            "merged LoRA:  style.safetensors at 0.8 (sha256 cd34)",
        ],
    );
}

/// `klein info` names the CPU and, for int8 codes run by u8 x s8 kernels, what this CPU does with
/// them: 8-bit codes converted to uint8 exactly where VNNI is missing (x86-64), 7-bit codes never.
#[test]
fn info_says_how_this_cpu_runs_int8_weights() {
    let plain = klein(["info"]);
    assert_eq!(plain.code, Some(0), "{}", plain.describe());
    assert!(plain.stdout.contains("cpu:          "), "{}", plain.stdout);
    assert!(!plain.stdout.contains("int8 kernels:"), "{}", plain.stdout);

    let bundle = BundleCopy::new("cli-info-int8");
    let path = bundle.file("manifest.json");
    let mut manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let dynamic = |reduce_range: bool| serde_json::json!({"method": "DynamicQuantizeMatMul", "bits": 8, "reduce_range": reduce_range});
    manifest["graphs"]["text_encoder"]["quantization"] = dynamic(false);
    manifest["graphs"]["transformer"]["quantization"] = dynamic(true);
    std::fs::write(&path, serde_json::to_vec(&manifest).unwrap()).unwrap();
    let run = klein(["info", bundle.arg()]);
    assert_eq!(run.code, Some(0), "{}", run.describe());
    let line = run
        .stdout
        .lines()
        .find(|l| l.starts_with("int8 kernels: "))
        .unwrap_or_else(|| panic!("no int8 kernels line in:\n{}", run.stdout));
    assert!(line.contains("text_encoder (8-bit codes)"), "{line}");
    // The graphs' quantization in words, not the manifest's JSON.
    assert_mentions(
        &run.stdout,
        &[
            "int8 weights and activations (--method dynamic), 8-bit codes per output channel",
            "int8 weights and activations (--method dynamic), 7-bit codes per output channel",
            "vae_decoder",
        ],
    );
    assert!(!run.stdout.contains("\"method\""), "{}", run.stdout);
    assert!(
        line.contains(
            "transformer (7-bit codes, --reduce-range): u8 x s8 kernels, exact on every CPU"
        ),
        "{line}"
    );
    #[cfg(target_arch = "x86_64")]
    let no_vnni = !(std::arch::is_x86_feature_detected!("avxvnni")
        || std::arch::is_x86_feature_detected!("avx512vnni"));
    #[cfg(not(target_arch = "x86_64"))]
    let no_vnni = false;
    assert_eq!(
        line.contains("this CPU has no VNNI, so ONNX Runtime converts these weights to uint8"),
        no_vnni,
        "{line}"
    );
}

/// `klein info | head -1`: the reader closes the pipe after one line; the CLI ends as other Unix
/// tools do (SIGPIPE), not with a panic and its backtrace.
#[cfg(unix)]
#[test]
fn info_into_a_closed_pipe_ends_quietly() {
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let done = Command::new(env!("CARGO_BIN_EXE_klein"))
        .args(["info", "--verify"])
        .env("ORT_DYLIB_PATH", ort_library())
        .env("KLEIN_CACHE_DIR", test_cache_dir())
        .env_remove("KLEIN_MODEL")
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(done.status.signal(), Some(13), "ended by SIGPIPE: {stderr}");
}

#[test]
fn info_prints_the_bundle_summary_and_verifies_hashes() {
    // The default model: the bundled tiny model, written to the cache directory.
    let bundle = test_cache_dir().join("bundled").display().to_string();
    let summary = [
        bundle.as_str(),
        "klein-tiny (FLUX.2-klein, variant tiny, distilled)",
        "4 steps, guidance 1, 1024x1024",
        "text_encoder",
        "transformer",
        "vae_encoder",
        "vae_decoder",
        "ONNX Runtime >= 1.31.0",
    ];
    let run = klein(["info"]);
    assert_eq!(run.code, Some(0), "{}", run.describe());
    assert_mentions(&run.stdout, &summary);
    assert!(
        !run.stdout.contains("hashes"),
        "hashes are checked only with --verify:\n{}",
        run.describe()
    );
    let run = klein(["info", "--verify"]);
    assert_eq!(run.code, Some(0), "{}", run.describe());
    assert_mentions(&run.stdout, &summary);
    assert_mentions(&run.stdout, &["all 5 files match the manifest"]);
}

// ---- bad bundles ----

#[test]
fn missing_bundle_directory_is_refused() {
    let missing = temp_dir("cli-no-bundle").join("no-such-bundle");
    assert_refused(
        &["-m", path_str(&missing)],
        &[path_str(&missing), "does not exist"],
    );
    klein(["info".as_ref(), missing.as_os_str()])
        .assert_user_error(&[path_str(&missing), "does not exist"]);
}

#[test]
fn bundle_with_a_missing_file_is_refused() {
    let bundle = BundleCopy::new("cli-missing-file");
    std::fs::remove_file(bundle.file("vae_decoder.onnx")).unwrap();
    assert_refused(
        &[&["-m", bundle.arg()], &FAST[..]].concat(),
        &["vae_decoder.onnx", "missing"],
    );
}

/// Garbage of the right size: by default the sha256 check refuses it before any graph loads (the
/// text encoder, the first graph loaded, is the broken one: had it loaded first, the error would
/// be the loader's); with --no-verify-hashes, ONNX Runtime's loader refuses it, naming the file.
/// That error comes while the transformer loads on another thread, which the process waits for
/// before it exits: five runs, each exit code 2 (exiting during the load crashed it with SIGSEGV
/// in 4 runs of 10).
#[test]
fn corrupt_graph_is_refused_by_the_hash_check_or_the_loader() {
    let bundle = BundleCopy::new("cli-corrupt");
    corrupt(&bundle.file("text_encoder.onnx"));
    let m = ["-m", bundle.arg()];
    let run = assert_refused(
        &[&m[..], &FAST[..]].concat(),
        &["text_encoder.onnx", "sha256", "manifest.json"],
    );
    assert!(
        !run.stderr.contains("ONNX Runtime"),
        "hashes are checked before loading:\n{}",
        run.describe()
    );
    for _ in 0..5 {
        assert_refused(
            &[&m[..], &FAST[..], &["--no-verify-hashes"]].concat(),
            &[
                "text_encoder.onnx",
                "cannot read it as the text_encoder graph",
                "--verify",
            ],
        );
    }
    klein(["info", bundle.arg(), "--verify"]).assert_user_error(&["text_encoder.onnx", "sha256"]);
}

/// The stamp files under `<cache>/verified/`.
fn stamps(cache: &Path) -> Vec<String> {
    let dir = cache.join("verified");
    if dir.is_dir() {
        files_in(&dir)
    } else {
        Vec::new()
    }
}

/// A verified bundle gets a stamp in $KLEIN_CACHE_DIR, else $XDG_CACHE_HOME/klein, else
/// $HOME/.cache/klein. A file rewritten afterwards (same size, fresh modification time) is still
/// refused by its sha256, the stamp notwithstanding.
#[test]
fn hash_stamps_go_to_the_cache_directory_and_do_not_hide_tampering() {
    let bundle = BundleCopy::new("cli-stamp");
    backdate(bundle.path());
    let root = temp_dir("cli-stamp-cache");
    let (klein_cache, xdg, home) = (root.join("klein"), root.join("xdg"), root.join("home"));
    let args = [
        &["generate", "a cat", "-m", bundle.arg(), "-q"][..],
        &FAST[..],
    ]
    .concat();
    let out = root.join("out.png");
    let with_out = [&args[..], &["-o", path_str(&out)]].concat();
    for (env, stamp_dir) in [
        (
            [
                ("KLEIN_CACHE_DIR", Some(klein_cache.as_os_str())),
                ("XDG_CACHE_HOME", Some(xdg.as_os_str())),
                ("HOME", Some(home.as_os_str())),
            ],
            klein_cache.clone(),
        ),
        (
            [
                ("KLEIN_CACHE_DIR", None),
                ("XDG_CACHE_HOME", Some(xdg.as_os_str())),
                ("HOME", Some(home.as_os_str())),
            ],
            xdg.join("klein"),
        ),
        (
            [
                ("KLEIN_CACHE_DIR", None),
                ("XDG_CACHE_HOME", None),
                ("HOME", Some(home.as_os_str())),
            ],
            home.join(".cache/klein"),
        ),
    ] {
        let run = klein_env(&with_out, &env);
        run.assert_success(&[&out]);
        assert_eq!(
            stamps(&stamp_dir).len(),
            1,
            "one stamp in {}:\n{}",
            stamp_dir.display(),
            run.describe()
        );
    }
    corrupt(&bundle.file("vae_decoder.onnx"));
    let run = klein_env(
        &with_out,
        &[("KLEIN_CACHE_DIR", Some(klein_cache.as_os_str()))],
    );
    run.assert_user_error(&["vae_decoder.onnx", "sha256", "do not match manifest.json"]);
}

#[test]
fn truncated_graph_is_refused() {
    let bundle = BundleCopy::new("cli-truncated");
    let file = bundle.file("transformer.onnx");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let (half, full) = ((bytes.len() / 2).to_string(), bytes.len().to_string());
    assert_refused(
        &[&["-m", bundle.arg()], &FAST[..]].concat(),
        &["transformer.onnx", &half, &full, "truncated"],
    );
}

#[test]
fn manifest_of_another_format_version_is_refused() {
    let bundle = BundleCopy::new("cli-format-version");
    edit_manifest(bundle.path(), |m| m["format_version"] = 2.into());
    assert_refused(
        &[&["-m", bundle.arg()], &FAST[..]].concat(),
        &[
            "manifest.json",
            "format_version 2 is not supported",
            "format version 1",
        ],
    );
}

/// A bundle that needs a newer ONNX Runtime than the one loaded is refused once the library
/// loads, naming both releases and the library; the loaded release itself runs (older ones: every
/// other test, with the exporter's 1.31.0); a malformed release is a manifest error.
#[test]
fn a_bundle_that_needs_a_newer_onnx_runtime_is_refused() {
    crate::util::init_runtime();
    let loaded = klein::runtime::runtime_info()
        .and_then(|info| info.version)
        .expect("the tests' library reports its release");
    let newer = format!("{}.{}.0", loaded.major, loaded.minor + 1);
    let bundle = BundleCopy::new("cli-newer-ort");
    let args = [&["-m", bundle.arg()], &FAST[..]].concat();
    let needing = |release: &str| {
        edit_manifest(bundle.path(), |m| {
            m["min_onnxruntime_version"] = release.into()
        })
    };
    needing(&newer);
    let needles = [
        "manifest.json".to_string(),
        format!("needs ONNX Runtime {newer} or newer"),
        "min_onnxruntime_version".to_string(),
        format!("in use is {loaded} ("),
        "libonnxruntime".to_string(),
    ];
    assert_refused(&args, &needles.each_ref().map(String::as_str));
    // `info` describes it, with the library it finds and the verdict, and succeeds.
    let run = klein(["info", bundle.arg()]);
    assert_eq!(run.code, Some(0), "{}", run.describe());
    let runtime_line = format!("runtime:      ONNX Runtime {loaded} (");
    assert_mentions(&run.stdout, &[&runtime_line, "TOO OLD for this bundle"]);
    needing(&loaded.to_string());
    let run = klein(["info", bundle.arg()]);
    assert_mentions(&run.stdout, &[&runtime_line, "): can run this bundle"]);
    let out = bundle.file("same-release.png");
    generate("a cat", &out, &args).assert_success(&[&out]);
    needing("latest");
    let needles = ["min_onnxruntime_version \"latest\" is not a release number"];
    assert_refused(&args, &needles);
}

#[test]
fn invalid_json_manifest_is_refused() {
    let bundle = BundleCopy::new("cli-bad-json");
    std::fs::write(
        bundle.file("manifest.json"),
        b"{\"format_version\": 1, \"model\": ",
    )
    .unwrap();
    assert_refused(
        &[&["-m", bundle.arg()], &FAST[..]].concat(),
        &["manifest.json", "not valid JSON"],
    );
}

/// manifest.json renames a transformer input (`timestep` -> `sigma`); nothing else changes
/// (manifest.json is not in its own `files`), so only the graph I/O check can tell.
#[test]
fn graph_that_does_not_match_its_manifest_is_refused() {
    let bundle = BundleCopy::new("cli-graph-mismatch");
    edit_manifest(bundle.path(), |m| {
        let inputs = m["graphs"]["transformer"]["inputs"].as_array_mut().unwrap();
        let timestep = inputs.iter_mut().find(|i| i["name"] == "timestep").unwrap();
        timestep["name"] = "sigma".into();
    });
    assert_refused(
        &[&["-m", bundle.arg()], &FAST[..]].concat(),
        &[
            "transformer.onnx",
            "does not match manifest.json",
            "`sigma`",
            "`timestep`",
        ],
    );
}

// ---- bad references ----

#[test]
fn text_file_named_png_is_refused() {
    let file = temp_dir("cli-ref-text").join("x.png");
    std::fs::write(&file, "this is not an image").unwrap();
    assert_refused(
        &[&FAST[..], &["--ref", path_str(&file)]].concat(),
        &[path_str(&file), "not a PNG, JPEG or WebP"],
    );
}

#[test]
fn empty_image_file_is_refused() {
    let file = temp_dir("cli-ref-empty").join("empty.png");
    std::fs::write(&file, b"").unwrap();
    assert_refused(
        &[&FAST[..], &["--ref", path_str(&file)]].concat(),
        &[path_str(&file), "empty"],
    );
}

/// A file where a cache directory should be: `--prompt-cache` and `--cpu-cache` are refused before
/// any work (the prompt cache was a warning after the image), and `KLEIN_CACHE_DIR` is named when
/// the bundled model cannot be written under it.
#[test]
fn a_file_is_not_a_cache_directory() {
    let dir = temp_dir("cli-cache-file");
    let file = dir.join("file");
    std::fs::write(&file, b"x").unwrap();
    for option in ["--prompt-cache", "--cpu-cache"] {
        let run = assert_refused(
            &[&FAST[..], &[option, path_str(&file)]].concat(),
            &[path_str(&file), "a file is there; give a directory"],
        );
        assert!(
            !run.stderr.contains("seed:"),
            "refused before the work:\n{}",
            run.describe()
        );
    }
    let out = dir.join("out.png");
    let run = klein_env(
        ["generate", "a cat", "-o", path_str(&out)],
        &[
            ("KLEIN_CACHE_DIR", Some(file.as_os_str())),
            ("KLEIN_MODEL", None),
        ],
    );
    run.assert_user_error(&[path_str(&file), "KLEIN_CACHE_DIR", "-m"]);
    assert!(!out.exists());
}

/// A directory given as an image (reference, source or mask) is refused as such.
#[test]
fn a_directory_is_not_an_image() {
    let dir = temp_dir("cli-image-dir");
    let source = solid_png(&dir.join("source.png"), 64, 64);
    let folder = path_str(&dir);
    for extra in [
        vec!["--ref", folder],
        vec!["--image", folder],
        vec!["--image", path_str(&source), "--mask", folder],
    ] {
        let run = generate("a cat", &dir.join("x.png"), &[&FAST[..], &extra].concat());
        run.assert_user_error(&[folder, "is a directory", "image file"]);
        assert!(!dir.join("x.png").exists(), "{}", run.describe());
    }
}

/// `--mask-crop` with a mask of another size, or a black one, is refused with the reason.
#[test]
fn mask_crop_needs_a_mask_of_the_source_size_with_a_region() {
    let dir = temp_dir("cli-mask-crop");
    let source = solid_png(&dir.join("source.png"), 96, 64);
    let small = solid_png(&dir.join("small.png"), 48, 32);
    let black = dir.join("black.png");
    image::GrayImage::new(96, 64).save(&black).unwrap();
    let args = |mask: &Path| {
        let mut args = FAST.map(String::from).to_vec();
        for arg in [
            "--image",
            path_str(&source),
            "--mask",
            path_str(mask),
            "--mask-crop",
            "8",
        ] {
            args.push(arg.to_string());
        }
        args
    };
    let run = |mask: &Path| {
        let args = args(mask);
        assert_refused(
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
            &[path_str(mask)],
        )
    };
    assert_mentions(
        &run(&small).stderr,
        &[
            "48x32",
            "96x64",
            "cropping to the mask needs a mask of the source's size",
        ],
    );
    assert_mentions(
        &run(&black).stderr,
        &["black everywhere", "so no region to crop to"],
    );
}

/// A reference with no size to check first (a device) is refused once the limit has been read,
/// not read until memory runs out.
#[cfg(unix)]
#[test]
fn an_endless_reference_is_refused_at_the_limit() {
    assert_refused(
        &[&FAST[..], &["--ref", "/dev/zero"]].concat(),
        &[
            "/dev/zero",
            "larger than this runtime decodes",
            "at most 512 MiB",
        ],
    );
}

#[test]
fn missing_reference_is_refused() {
    let file = temp_dir("cli-ref-missing").join("missing.png");
    assert_refused(
        &[&FAST[..], &["--ref", path_str(&file)]].concat(),
        &["--ref: ", path_str(&file), "open image file"],
    );
}

/// Each input image is read before the bundle: a mistyped path is refused naming its flag, even
/// where the bundle itself would fail (here a directory with no manifest).
#[test]
fn input_images_are_refused_before_the_bundle_loads_naming_their_flag() {
    let dir = temp_dir("cli-inputs-first");
    let missing = dir.join("missing.png");
    let not_an_image = repo().join("Cargo.toml");
    let source = solid_png(&dir.join("source.png"), 64, 64);
    let no_bundle = dir.join("no-bundle");
    std::fs::create_dir(&no_bundle).unwrap();
    let model = ["--model", path_str(&no_bundle)];
    for (flags, needles) in [
        (
            vec!["--image", path_str(&missing)],
            vec!["--image: ", path_str(&missing), "open image file"],
        ),
        (
            vec![
                "--image",
                path_str(&not_an_image),
                "--mask",
                path_str(&missing),
            ],
            vec!["--image: ", "Cargo.toml", "not a PNG, JPEG or WebP"],
        ),
        (
            vec!["--mask", path_str(&missing), "--image", path_str(&source)],
            vec!["--mask: ", path_str(&missing)],
        ),
    ] {
        assert_refused(&[&FAST[..], &model, &flags].concat(), &needles);
    }
}

/// A valid PNG signature and IHDR declaring `width x height` 8-bit RGB, then an empty IDAT and IEND.
pub(crate) fn png_header_only(width: u32, height: u32) -> Vec<u8> {
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut chunk = |kind: &[u8; 4], data: &[u8]| {
        let mut typed = kind.to_vec();
        typed.extend(data);
        png.extend((data.len() as u32).to_be_bytes());
        png.extend(&typed);
        png.extend(crc32fast::hash(&typed).to_be_bytes());
    };
    let mut ihdr = width.to_be_bytes().to_vec();
    ihdr.extend(height.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]);
    chunk(b"IHDR", &ihdr);
    chunk(b"IDAT", &[]);
    chunk(b"IEND", &[]);
    png
}

/// A 100000x100000 PNG header (30 GB of pixels) is refused before anything is allocated.
#[test]
fn absurdly_large_image_is_refused() {
    let file = temp_dir("cli-ref-huge").join("huge.png");
    std::fs::write(&file, png_header_only(100_000, 100_000)).unwrap();
    assert_refused(
        &[&FAST[..], &["--ref", path_str(&file)]].concat(),
        &[
            path_str(&file),
            "larger than this runtime decodes",
            "16384 px",
        ],
    );
}

#[test]
fn reference_under_64_pixels_is_refused() {
    let file = solid_png(&temp_dir("cli-ref-small").join("small.png"), 32, 48);
    assert_refused(
        &[&FAST[..], &["--ref", path_str(&file)]].concat(),
        &[path_str(&file), "too small: 32x48", "at least 64px"],
    );
}

/// Six 1024x1024 references are 6 x 4096 tokens, over the budget of 20480. The budget is checked
/// before any graph loads: every graph of this bundle copy is garbage (and the hash check, which
/// would refuse them first, is off), and the error is still the budget's (so no VAE encoding was
/// spent on it).
#[test]
fn more_references_than_the_token_budget_are_refused_before_encoding() {
    let bundle = BundleCopy::new("cli-token-budget");
    for graph in ["text_encoder", "transformer", "vae_encoder", "vae_decoder"] {
        corrupt(&bundle.file(&format!("{graph}.onnx")));
    }
    let reference = solid_png(&temp_dir("cli-ref-budget").join("big.png"), 1024, 1024);
    let mut args = vec![
        "-m",
        bundle.arg(),
        "--width",
        "64",
        "--height",
        "64",
        "--no-verify-hashes",
    ];
    for _ in 0..6 {
        args.extend(["--ref", path_str(&reference)]);
    }
    let run = assert_refused(
        &args,
        &[
            "24592 image tokens",
            "6 reference(s)",
            "at most 20480",
            "fewer or smaller references",
        ],
    );
    assert!(
        !run.stderr.contains("ONNX Runtime"),
        "no graph should load:\n{}",
        run.describe()
    );
}

/// The token budget is checked on the references' headers, before any is decoded: five
/// 1024x1024 headers without pixel data are refused for the budget, not for their missing pixels.
#[test]
fn the_token_budget_is_checked_before_any_reference_is_decoded() {
    let dir = temp_dir("cli-ref-headers");
    let header = dir.join("header-only.png");
    std::fs::write(&header, png_header_only(1024, 1024)).unwrap();
    let mut args = vec!["--width", "1024", "--height", "1024"];
    for _ in 0..5 {
        args.extend(["--ref", path_str(&header)]);
    }
    let run = assert_refused(
        &args,
        &["24576 image tokens", "5 reference(s)", "at most 20480"],
    );
    assert!(!run.stderr.contains("decode"), "{}", run.describe());
}

// ---- bad options ----

#[test]
fn sizes_outside_16_to_4096_are_refused() {
    for (flag, value) in [
        ("--width", "0"),
        ("--height", "0"),
        ("--width", "5000"),
        ("--width", "8"),
    ] {
        let what = &flag[2..];
        // A bundle that does not exist: the bound is checked before the bundle is read.
        let run = assert_refused(
            &[
                "--steps",
                "2",
                "--model",
                "/nonexistent/klein-bundle",
                flag,
                value,
            ],
            &[
                &format!("{what} {value} is out of range"),
                "between 16 and 4096 pixels",
            ],
        );
        assert!(
            !run.stderr.contains("device:"),
            "refused before generating:\n{}",
            run.describe()
        );
    }
}

/// Bounds that need no bundle are checked before it is read: each of these names its bound, not
/// the bundle that does not exist.
#[test]
fn bounds_are_checked_before_the_bundle_is_read() {
    let cases: [(&[&str], &[&str]); 4] = [
        (
            &["--width", "4096", "--height", "4096"],
            &["65536 image tokens", "at most 20480"],
        ),
        (
            &["--image", "source.png", "--strength", "1.5"],
            &["strength 1.5 must be above 0 and at most 1"],
        ),
        (
            &["--vae-tile-size", "100"],
            &["VAE tile size 100", "multiple of 64"],
        ),
        (
            &["--vae-tile-size", "8192"],
            &["VAE tile size 8192", "up to 4096"],
        ),
    ];
    for (args, needles) in cases {
        let args = [&["--model", "/nonexistent/klein-bundle"][..], args].concat();
        let run = assert_refused(&args, needles);
        assert!(!run.stderr.contains("/nonexistent"), "{}", run.describe());
    }
}

#[test]
fn zero_steps_is_refused() {
    assert_refused(
        &["--width", "64", "--height", "64", "--steps", "0"],
        &["steps is 0", "between 1 and"],
    );
}

#[test]
fn zero_images_is_refused() {
    assert_refused(
        &[&FAST[..], &["--num-images", "0"]].concat(),
        &["--num-images", "1..=16"],
    );
}

/// A negative number is the option's value, refused naming the option and its valid values (not
/// read as an unknown flag, whose tip would make it the prompt).
#[test]
fn negative_numbers_are_refused_as_the_options_values() {
    for (option, value, valid) in [
        ("--width", "-16", "16 to 4096"),
        ("--height", "-1", "16 to 4096"),
        ("--steps", "-1", "1 to 1000"),
        ("--seed", "-1", "0 to 18446744073709551615"),
        ("--threads", "-2", "1 to 1024"),
        ("--prompt-cache-max-mib", "-1", "1 to 16777216"),
        ("--cpu-cache-max-gib", "-1", "1 to 16384"),
        ("--num-images", "-1", "1..=16"),
    ] {
        let run = assert_refused(&[option, value], &[option, value, valid]);
        assert!(!run.stderr.contains("tip:"), "{}", run.describe());
    }
}

#[test]
fn unknown_device_is_refused() {
    assert_refused(
        &[&FAST[..], &["--device", "gpu"]].concat(),
        &["unknown device `gpu`", "cpu, cuda, cuda:N, coreml or auto"],
    );
}

/// Asking for CUDA from a build without it is an error, never a silent fall back to the CPU.
#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_cuda_feature_is_refused() {
    let run = assert_refused(
        &[&FAST[..], &["--device", "cuda"]].concat(),
        &[
            "device cuda:0",
            "built without CUDA support",
            "--features cuda",
        ],
    );
    assert!(
        !run.stderr.contains("device: cpu"),
        "fell back to the CPU:\n{}",
        run.describe()
    );
}

#[test]
fn missing_output_directory_is_refused_before_generating() {
    let out = temp_dir("cli-no-out-dir")
        .join("no-such-dir")
        .join("out.png");
    let run = generate("a cat", &out, &FAST);
    run.assert_user_error(&[path_str(&out), "does not exist"]);
    assert!(
        !run.stderr.contains("seed:"),
        "refused before generating:\n{}",
        run.describe()
    );
}

/// The output is written atomically: a failing run leaves an existing file as it was.
#[test]
fn failing_run_leaves_an_existing_output_untouched() {
    let dir = temp_dir("cli-atomic");
    let out = dir.join("out.png");
    std::fs::write(&out, b"previous image").unwrap();
    let bad = temp_dir("cli-atomic-ref").join("bad.png");
    std::fs::write(&bad, "not an image").unwrap();
    let run = generate(
        "a cat",
        &out,
        &[&FAST[..], &["--ref", path_str(&bad)]].concat(),
    );
    run.assert_user_error(&[path_str(&bad)]);
    assert_eq!(
        std::fs::read(&out).unwrap(),
        b"previous image",
        "the existing output changed"
    );
    assert_eq!(files_in(&dir), ["out.png"], "no temporary file is left");
}

/// A copy of the binary elsewhere (as `cargo install` makes) still has its default model: the
/// bundled tiny model is written to the cache directory and used from there.
#[test]
fn a_copied_binary_keeps_its_default_model() {
    let dir = temp_dir("cli-installed");
    let exe = dir.join("klein");
    std::fs::copy(env!("CARGO_BIN_EXE_klein"), &exe).unwrap();
    let cache = dir.join("cache");
    // `klein generate` with no --model, from the copy, writing `name` in `dir`.
    let generate_to = |name: &str| {
        let output = Command::new(&exe)
            .args(["generate", "a cat", "-o"])
            .arg(dir.join(name))
            .args(FAST)
            .env("ORT_DYLIB_PATH", ort_library())
            .env("KLEIN_CACHE_DIR", &cache)
            .env_remove("KLEIN_MODEL")
            .current_dir(&dir)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.success(), "{stderr}");
        assert!(dir.join(name).is_file());
    };
    generate_to("out.png");
    let bundled: Vec<String> = files_in(&cache.join("bundled"));
    assert_eq!(bundled.len(), 1, "{bundled:?}");
    let copy = cache.join("bundled").join(&bundled[0]);
    assert!(copy.join("manifest.json").is_file());
    // A copy damaged in the cache (a file cleaned away, one cut short) is written again.
    std::fs::remove_file(copy.join("tokenizer.json")).unwrap();
    let graph = copy.join("transformer.onnx");
    let len = std::fs::metadata(&graph).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&graph)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    generate_to("again.png");
    for name in ["tokenizer.json", "transformer.onnx"] {
        let shipped = std::fs::read(bundle_dir().join(name)).unwrap();
        assert!(
            std::fs::read(copy.join(name)).unwrap() == shipped,
            "{name} repaired"
        );
    }
}

/// Empty values: `--lora ''` is refused as no file (it read as a LoRA named ""), an empty
/// `KLEIN_MODEL` is no model (the bundled one), as the Python module reads it; an output whose
/// directory is a file says so (it said the directory did not exist).
#[test]
fn empty_values_and_a_file_for_a_directory() {
    assert_refused(
        &[&FAST[..], &["--lora", ""]].concat(),
        &["give a LoRA file"],
    );
    let run = klein_env(
        ["info"],
        &[
            ("KLEIN_MODEL", Some(OsStr::new(""))),
            ("KLEIN_CACHE_DIR", Some(test_cache_dir().as_os_str())),
        ],
    );
    assert!(run.stdout.contains("klein-tiny"), "{}", run.describe());
    let dir = temp_dir("cli-file-parent");
    std::fs::write(dir.join("file"), "x").unwrap();
    let out = dir.join("file").join("out.png");
    generate("a cat", &out, &FAST).assert_user_error(&["file is not a directory"]);
}
