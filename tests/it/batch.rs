//! `klein generate --prompts FILE --out-dir DIR` end to end on the bundled tiny model: outputs equal
//! to single-mode runs byte for byte, reruns that skip what exists, bad lines reported while the
//! others run, the summary, and the exit codes. 64x64 pixels, 2 steps.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde_json::Value;

use crate::cli::{
    corrupt, files_in, generate, klein, path_str, read_png, solid_png, BundleCopy, Run, FAST,
};
use crate::util::{assert_mentions, temp_dir};

/// Writes `lines` as `prompts.jsonl` in `dir`.
fn prompts_file(dir: &Path, lines: &[&str]) -> PathBuf {
    let path = dir.join("prompts.jsonl");
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

/// `generate --prompts <prompts> --out-dir <out_dir>`.
fn batch_args<'a>(prompts: &'a Path, out_dir: &'a Path) -> Vec<&'a str> {
    vec![
        "generate",
        "--prompts",
        path_str(prompts),
        "--out-dir",
        path_str(out_dir),
    ]
}

/// `klein generate --prompts <prompts> --out-dir <out_dir> <extra...>`.
fn batch(prompts: &Path, out_dir: &Path, extra: &[&str]) -> Run {
    let mut args = batch_args(prompts, out_dir);
    args.extend(extra);
    klein(args)
}

fn summary(out_dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(out_dir.join("summary.json")).unwrap()).unwrap()
}

/// `(name, status)` of every line of the summary, in file order.
fn statuses(summary: &Value) -> Vec<(String, String)> {
    summary["lines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l["name"].as_str().unwrap().to_string(),
                l["status"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The summary's record of the line named `name`.
fn record<'a>(summary: &'a Value, name: &str) -> &'a Value {
    summary["lines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == name)
        .unwrap_or_else(|| panic!("no line `{name}` in {summary:#}"))
}

fn modified(path: &Path) -> SystemTime {
    std::fs::metadata(path).unwrap().modified().unwrap()
}

/// Three lines, the first prompt again on the third (whose embeddings the batch keeps from the
/// first), the second without a seed: every PNG equals, byte for byte (pixels and metadata), the
/// single-mode run of the same prompt, seed and size. The random seed is in the summary and the
/// PNG.
#[test]
fn batch_outputs_equal_single_runs_byte_for_byte() {
    let dir = temp_dir("batch-equal");
    let prompts = prompts_file(
        &dir,
        &[
            r#"{"prompt": "a red fox in the snow", "seed": 11}"#,
            r#"{"prompt": "a lighthouse at dusk", "name": "house"}"#,
            r#"{"prompt": "a red fox in the snow", "seed": 12, "width": 48, "height": 32}"#,
        ],
    );
    let out_dir = dir.join("out");
    let run = batch(&prompts, &out_dir, &FAST);
    let outputs = ["0001.png", "house.png", "0003.png"].map(|n| out_dir.join(n));
    run.assert_success(&[&outputs[0], &outputs[1], &outputs[2]]);
    assert_mentions(&run.stderr, &["3 ok", "0 skipped", "0 failed"]);

    let summary = summary(&out_dir);
    assert_eq!(
        statuses(&summary),
        [("0001", "ok"), ("house", "ok"), ("0003", "ok")].map(|(n, s)| (n.into(), s.into()))
    );
    assert_eq!(summary["totals"]["ok"], 3, "{summary:#}");
    let random_seed = record(&summary, "house")["seed"].as_u64().unwrap();
    assert_eq!(
        read_png(&outputs[1]).text.get("seed"),
        Some(&random_seed.to_string()),
        "the random seed is stored in the PNG"
    );

    let singles = [
        ("a red fox in the snow", 11, &FAST[..]),
        ("a lighthouse at dusk", random_seed, &FAST[..]),
        (
            "a red fox in the snow",
            12,
            &["--width", "48", "--height", "32", "--steps", "2"][..],
        ),
    ];
    for ((prompt, seed, size), batch_output) in singles.into_iter().zip(&outputs) {
        let single = dir.join(format!("single-{seed}.png"));
        let seed = seed.to_string();
        generate(prompt, &single, &[size, &["--seed", &seed]].concat()).assert_success(&[&single]);
        let (expected, got) = (
            std::fs::read(&single).unwrap(),
            std::fs::read(batch_output).unwrap(),
        );
        assert!(
            expected == got,
            "{} ({} bytes) differs from the single run {} ({} bytes); pixels equal: {}",
            batch_output.display(),
            got.len(),
            single.display(),
            expected.len(),
            read_png(&single).pixels == read_png(batch_output).pixels
        );
    }
}

/// A rerun skips every line whose output exists (summary: skipped, with the seed stored in the
/// PNG; the files are not rewritten) and makes only the missing ones.
#[test]
fn rerun_skips_existing_outputs() {
    let dir = temp_dir("batch-rerun");
    // The file starts with a byte-order mark, as some editors write: the first line still runs.
    let prompts = prompts_file(
        &dir,
        &[
            "\u{feff}{\"prompt\": \"a cat\", \"seed\": 1}",
            r#"{"prompt": "a dog"}"#,
        ],
    );
    let out_dir = dir.join("out");
    let (cat, dog) = (out_dir.join("0001.png"), out_dir.join("0002.png"));
    batch(&prompts, &out_dir, &FAST).assert_success(&[&cat, &dog]);
    let dog_seed = record(&summary(&out_dir), "0002")["seed"].clone();
    let before = [&cat, &dog].map(|p| (modified(p), std::fs::read(p).unwrap()));

    let rerun = batch(&prompts, &out_dir, &FAST);
    rerun.assert_success(&[]);
    assert!(
        !rerun.stderr.contains("model:"),
        "nothing to run, so no bundle is loaded:\n{}",
        rerun.describe()
    );
    let again = summary(&out_dir);
    assert_eq!(
        statuses(&again),
        [("0001", "skipped"), ("0002", "skipped")].map(|(n, s)| (n.into(), s.into()))
    );
    assert_eq!(
        record(&again, "0002")["seed"],
        dog_seed,
        "seed read from the PNG"
    );
    assert_eq!(again["totals"]["skipped"], 2);
    assert_eq!(
        again["model"], "klein-tiny",
        "a run that loads nothing still names the model"
    );
    for (path, (time, bytes)) in [&cat, &dog].into_iter().zip(&before) {
        assert_eq!(modified(path), *time, "{} was rewritten", path.display());
        assert_eq!(&std::fs::read(path).unwrap(), bytes);
    }

    std::fs::remove_file(&cat).unwrap();
    batch(&prompts, &out_dir, &FAST).assert_success(&[&cat]);
    assert_eq!(
        statuses(&summary(&out_dir)),
        [("0001", "ok"), ("0002", "skipped")].map(|(n, s)| (n.into(), s.into()))
    );
    assert_eq!(
        std::fs::read(&cat).unwrap(),
        before[0].1,
        "same seed, same image"
    );
    assert_eq!(modified(&dog), before[1].0);
}

/// A line that is not UTF-8 and a line whose output path is a directory fail alone: the lines
/// around them run.
#[test]
fn a_line_not_in_utf8_or_whose_output_is_a_folder_fails_alone() {
    let dir = temp_dir("batch-utf8");
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        b"{\"prompt\": \"ok\"}\n{\"prompt\": \"caf\xe9\"}\n{\"prompt\": \"x\", \"name\": \"taken\"}\n{\"prompt\": \"ok2\"}\n",
    )
    .unwrap();
    let out_dir = dir.join("out");
    std::fs::create_dir_all(out_dir.join("taken.png")).unwrap();
    let run = batch(&prompts, &out_dir, &FAST);
    assert_eq!(run.code, Some(2), "{}", run.describe());
    assert_mentions(
        &run.stderr,
        &["line 2", "not UTF-8", "line 3", "taken.png", "not a file"],
    );
    assert_eq!(
        statuses(&summary(&out_dir)),
        [
            ("0001", "ok"),
            ("0002", "error"),
            ("taken", "error"),
            ("0004", "ok")
        ]
        .map(|(n, s)| (n.into(), s.into()))
    );
}

/// A line whose output cannot be written (a symbolic link into a missing directory) fails before
/// its image is generated, as a single run's output does; the other lines run.
#[cfg(unix)]
#[test]
fn an_unwritable_line_output_fails_before_generating() {
    let dir = temp_dir("batch-dangling");
    let prompts = prompts_file(
        &dir,
        &[
            r#"{"prompt": "one", "name": "dangling"}"#,
            r#"{"prompt": "two"}"#,
        ],
    );
    let out_dir = dir.join("out");
    std::fs::create_dir(&out_dir).unwrap();
    std::os::unix::fs::symlink(dir.join("missing/x.png"), out_dir.join("dangling.png")).unwrap();
    let run = batch(&prompts, &out_dir, &FAST);
    assert_eq!(run.code, Some(2), "{}", run.describe());
    assert_mentions(
        &run.stderr,
        &[
            "line 1 (dangling): output",
            "missing: create a file in the directory",
        ],
    );
    assert!(
        !run.stderr.contains("line 1 (dangling): seed"),
        "generated first:\n{}",
        run.describe()
    );
    assert_eq!(
        statuses(&summary(&out_dir)),
        [("dangling", "error"), ("0002", "ok")].map(|(n, s)| (n.into(), s.into()))
    );
}

/// Invalid JSON, a missing prompt, an unknown key, a missing reference and zero steps are each
/// reported (stderr and summary, naming the line); the other lines run, including one whose
/// reference is relative to the prompts file's directory; the exit code is 2; no partial or
/// temporary file is left.
#[test]
fn bad_lines_are_reported_and_the_others_succeed() {
    let dir = temp_dir("batch-bad");
    std::fs::create_dir(dir.join("refs")).unwrap();
    solid_png(&dir.join("refs/ok.png"), 64, 64);
    let prompts = prompts_file(
        &dir,
        &[
            r#"{"prompt": "first", "seed": 1}"#,
            r#"{"prompt": "unclosed"#,
            r#"{"seed": 2}"#,
            r#"{"prompt": "typo", "sead": 3}"#,
            r#"{"prompt": "no such ref", "refs": ["missing.png"]}"#,
            r#"{"prompt": "edit", "refs": ["refs/ok.png"], "seed": 4, "name": "edit"}"#,
            r#"{"prompt": "no steps", "steps": 0}"#,
            r#"{"prompt": "crop, no image", "mask_crop": 99999}"#,
            r#"{"prompt": "last", "seed": 5}"#,
        ],
    );
    let out_dir = dir.join("out");
    let run = batch(&prompts, &out_dir, &FAST);
    assert_eq!(run.code, Some(2), "{}", run.describe());
    assert!(!run.stderr.contains("panicked"), "{}", run.describe());
    let written = ["0001.png", "edit.png", "0009.png"].map(|n| out_dir.join(n));
    let expected_stdout: String = written
        .iter()
        .map(|p| format!("{}\n", p.display()))
        .collect();
    assert_eq!(run.stdout, expected_stdout, "{}", run.describe());
    assert_mentions(
        &run.stderr,
        &[
            "line 2: invalid JSON",
            "line 3: invalid line: missing field `prompt`",
            "line 4: invalid line: unknown field `sead`",
            "line 5 (0005)",
            "missing.png",
            "line 7 (0007)",
            "steps is 0",
            "line 8 (0008)",
            "a mask, a strength or a mask crop needs a source image",
            "3 ok",
            "6 failed (6 user error(s))",
        ],
    );

    let summary = summary(&out_dir);
    assert_eq!(
        statuses(&summary),
        [
            ("0001", "ok"),
            ("0002", "error"),
            ("0003", "error"),
            ("0004", "error"),
            ("0005", "error"),
            ("edit", "ok"),
            ("0007", "error"),
            ("0008", "error"),
            ("0009", "ok"),
        ]
        .map(|(n, s)| (n.into(), s.into()))
    );
    for (name, needle) in [
        ("0002", "invalid JSON"),
        ("0003", "missing field `prompt`"),
        ("0005", "missing.png"),
        ("0007", "steps is 0"),
        ("0008", "needs a source image"),
    ] {
        let line = record(&summary, name);
        assert_eq!(line["error_kind"], "user", "{line:#}");
        assert_mentions(line["message"].as_str().unwrap(), &[needle]);
    }
    assert_eq!(record(&summary, "0004")["prompt"], "typo");
    assert_eq!(summary["totals"]["error"], 6);
    let edit = read_png(&out_dir.join("edit.png"));
    assert_eq!(
        edit.text.get("references"),
        Some(&serde_json::to_string(&[path_str(&dir.join("refs/ok.png"))]).unwrap())
    );
    assert_eq!(
        files_in(&out_dir),
        ["0001.png", "0009.png", "edit.png", "summary.json"],
        "only the outputs and the summary"
    );
}

/// A bundle error (here the VAE decoder, garbage, loaded at the first line's decode) would hit
/// every line: the batch stops, the other lines are `not_run`, and the exit code is 2.
#[test]
fn a_bundle_error_stops_the_batch() {
    let bundle = BundleCopy::new("batch-bundle-error");
    corrupt(&bundle.file("vae_decoder.onnx"));
    let dir = temp_dir("batch-bundle-error-out");
    let prompts = prompts_file(
        &dir,
        &[
            r#"{"prompt": "a"}"#,
            r#"{"prompt": "b"}"#,
            r#"{"prompt": "c"}"#,
        ],
    );
    let out_dir = dir.join("out");
    let run = batch(
        &prompts,
        &out_dir,
        &[&FAST[..], &["-m", bundle.arg(), "--no-verify-hashes"]].concat(),
    );
    run.assert_user_error(&["line 1 (0001)", "vae_decoder.onnx", "2 not run"]);
    let summary = summary(&out_dir);
    assert_eq!(
        statuses(&summary),
        [("0001", "error"), ("0002", "not_run"), ("0003", "not_run")]
            .map(|(n, s)| (n.into(), s.into()))
    );
    assert_mentions(
        record(&summary, "0002")["message"].as_str().unwrap(),
        &["not run", "vae_decoder.onnx"],
    );
    assert_eq!(files_in(&out_dir), ["summary.json"]);
}

/// --prompts goes with --out-dir, and neither with a prompt, -o, --seed, --ref, --num-images or
/// --quality;
/// an unreadable, empty or endless prompts file and an unwritable --out-dir are refused. Exit code
/// 2 every time, and no output.
#[test]
fn batch_flags_are_checked() {
    let dir = temp_dir("batch-flags");
    let prompts = prompts_file(&dir, &[r#"{"prompt": "a"}"#]);
    let p = path_str(&prompts);
    let out = dir.join("out");
    let o = path_str(&out);
    for (args, needles) in [
        (
            vec!["a cat", "--prompts", p, "--out-dir", o],
            vec!["cannot be used with"],
        ),
        (
            vec!["--prompts", p, "--out-dir", o, "-o", "x.png"],
            vec!["--output"],
        ),
        (
            vec!["--prompts", p, "--out-dir", o, "--seed", "1"],
            vec!["--seed"],
        ),
        (
            vec!["--prompts", p, "--out-dir", o, "--ref", "r.png"],
            vec!["--ref"],
        ),
        (
            vec!["--prompts", p, "--out-dir", o, "--num-images", "2"],
            vec!["--num-images"],
        ),
        // Batch outputs are PNG files: a JPEG quality would be ignored.
        (
            vec!["--prompts", p, "--out-dir", o, "--quality", "50"],
            vec!["--quality"],
        ),
        (vec!["--prompts", p], vec!["--out-dir"]),
        (vec!["a cat", "--out-dir", o], vec!["--out-dir"]),
        (vec![], vec!["<PROMPT|--prompts <FILE>>"]),
    ] {
        let run = klein([&["generate"][..], &args].concat());
        run.assert_user_error(&needles);
    }
    assert!(!out.exists(), "nothing was written");

    let missing = dir.join("missing.jsonl");
    batch(&missing, &out, &FAST).assert_user_error(&[path_str(&missing), "cannot read it"]);
    let empty = dir.join("empty.jsonl");
    std::fs::write(&empty, "\n\n").unwrap();
    batch(&empty, &out, &FAST).assert_user_error(&[path_str(&empty), "has no lines"]);
    assert!(!out.exists(), "a refused batch leaves no --out-dir behind");
    // No size to check first: refused once the limit has been read.
    #[cfg(unix)]
    batch(Path::new("/dev/zero"), &out, &FAST).assert_user_error(&[
        "/dev/zero",
        "more than 67108864 bytes",
        "split it",
    ]);
    // A preview among the lines' outputs (a run cut short would leave it as a line's, done).
    let preview = out.join("a.png");
    batch(
        &prompts,
        &out,
        &[&FAST[..], &["--preview", path_str(&preview)]].concat(),
    )
    .assert_user_error(&["--preview", "is in --out-dir", "elsewhere"]);
    assert!(!preview.exists());
    // A directory no file can be created in (sysfs, also for root): refused before any line runs.
    #[cfg(target_os = "linux")]
    batch(&prompts, Path::new("/sys"), &FAST).assert_user_error(&[
        "--out-dir /sys",
        "create a file",
        "a directory you can write to",
    ]);
}

/// Inpainting lines (`image`, `mask`, `strength`, `mask_crop`) equal the single runs of
/// `--image --mask --strength --mask-crop`, byte for byte; the cropped one has the source's size.
#[test]
fn inpainting_lines_equal_single_runs() {
    let dir = temp_dir("batch-inpaint");
    image::RgbImage::from_fn(72, 52, |x, y| {
        image::Rgb([(x * 3) as u8, (y * 4) as u8, 90])
    })
    .save(dir.join("source.png"))
    .unwrap();
    image::RgbImage::from_fn(72, 52, |x, y| {
        let inside = (20..40).contains(&x) && (10..30).contains(&y);
        image::Rgb([if inside { 255 } else { 0 }; 3])
    })
    .save(dir.join("mask.png"))
    .unwrap();
    let prompts = prompts_file(
        &dir,
        &[
            r#"{"prompt": "a hat", "seed": 5, "image": "source.png", "mask": "mask.png", "strength": 0.75}"#,
            r#"{"prompt": "a hat", "seed": 5, "image": "source.png", "mask": "mask.png", "mask_crop": 6}"#,
        ],
    );
    let out_dir = dir.join("out");
    let run = batch(&prompts, &out_dir, &["--steps", "2"]);
    let outputs = ["0001.png", "0002.png"].map(|n| out_dir.join(n));
    run.assert_success(&[&outputs[0], &outputs[1]]);
    let (source, mask) = (dir.join("source.png"), dir.join("mask.png"));
    let inpaint = [
        "--image",
        path_str(&source),
        "--mask",
        path_str(&mask),
        "--seed",
        "5",
        "--steps",
        "2",
    ];
    let singles = [&["--strength", "0.75"][..], &["--mask-crop", "6"][..]];
    for (i, (extra, batch_output)) in singles.into_iter().zip(&outputs).enumerate() {
        let single = dir.join(format!("single-{i}.png"));
        generate("a hat", &single, &[&inpaint[..], extra].concat()).assert_success(&[&single]);
        assert!(
            std::fs::read(&single).unwrap() == std::fs::read(batch_output).unwrap(),
            "{} differs from the single run {}",
            batch_output.display(),
            single.display()
        );
    }
    let cropped = read_png(&outputs[1]);
    assert_eq!((cropped.width, cropped.height), (72, 52));
    assert_eq!(cropped.text.get("mask_crop").map(String::as_str), Some("6"));

    // The command line's --strength goes with its --image: lines with their own image are told
    // so once, and their outputs are as before (taken as done here: nothing reruns).
    std::fs::remove_file(&outputs[0]).unwrap();
    let strength = ["--image", path_str(&source), "--strength", "0.5"];
    let run = batch(
        &prompts,
        &out_dir,
        &[&["--steps", "2"][..], &strength].concat(),
    );
    run.assert_success(&[&outputs[0]]);
    assert_eq!(
        run.stderr
            .matches("1 line(s) give their own \"image\": the command line's --strength apply")
            .count(),
        1,
        "{}",
        run.describe()
    );
    let single = std::fs::read(dir.join("single-0.png")).unwrap();
    assert!(std::fs::read(&outputs[0]).unwrap() == single);
}

/// The command line's numbers, the lines' defaults, are checked before the bundle or the prompts
/// file is read, and nothing is written; nor for a bundle that is not there.
#[test]
fn command_line_bounds_are_checked_before_the_bundle_is_read() {
    let dir = temp_dir("batch-bounds");
    let prompts = prompts_file(&dir, &[r#"{"prompt": "a fox"}"#]);
    let out_dir = dir.join("out");
    let model = ["--model", "/nonexistent/klein-bundle"];
    for (extra, needles) in [
        (&["--steps", "0"][..], &["steps is 0"][..]),
        (
            &["--width", "5000"][..],
            &["width 5000 is out of range"][..],
        ),
    ] {
        let run = batch(&prompts, &out_dir, &[&model[..], extra].concat());
        run.assert_user_error(needles);
        assert!(!run.stderr.contains("/nonexistent"), "{}", run.describe());
        assert!(!out_dir.exists(), "{}", run.describe());
    }
    // A bundle that is not there is found after the out-dir is made: the directories made for it
    // (two levels here) are removed again.
    let nested = out_dir.join("nested");
    let run = batch(&prompts, &nested, &model);
    run.assert_user_error(&["/nonexistent/klein-bundle"]);
    assert!(!out_dir.exists(), "{}", run.describe());
}

/// SIGINT while a line runs: exit 130, and the summary says the batch was interrupted, the lines
/// not reached `not_run` (they were left `pending`, counted nowhere).
#[cfg(unix)]
#[test]
fn an_interrupted_batch_says_so_in_its_summary() {
    use std::time::Duration;

    let dir = temp_dir("batch-interrupt");
    let prompts = prompts_file(
        &dir,
        &[
            r#"{"prompt": "a", "width": 64, "height": 64, "steps": 1, "seed": 1}"#,
            r#"{"prompt": "b", "steps": 50, "seed": 2}"#,
            r#"{"prompt": "c", "seed": 3}"#,
        ],
    );
    let out_dir = dir.join("out");
    // Interrupted with line 1 done and line 2 (1024x1024, 50 steps) under way.
    let first = out_dir.join("0001.png");
    let ready = || {
        let done = first.exists();
        if done {
            std::thread::sleep(Duration::from_millis(500));
        }
        done
    };
    let output = crate::cli::interrupted_klein(batch_args(&prompts, &out_dir), ready);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("klein: interrupted"), "{stderr}");
    let summary = summary(&out_dir);
    assert_eq!(summary["interrupted"], true);
    assert_eq!(
        statuses(&summary),
        [("0001", "ok"), ("0002", "not_run"), ("0003", "not_run")]
            .map(|(n, s)| (n.to_string(), s.to_string()))
    );
    assert_eq!(summary["totals"]["not_run"], 2);
    assert_eq!(files_in(&out_dir), ["0001.png", "summary.json"]);

    // Interrupted before any line is done (loading, or in line 1): the summary of this run says
    // so, not an earlier run's left in place.
    // Three long lines (1024x1024, 50 steps) into the same directory: its earlier summary is
    // replaced before the bundle loads.
    let long = r#"{"prompt": "d", "steps": 50}"#;
    let slow = dir.join("slow");
    std::fs::create_dir(&slow).unwrap();
    let prompts = prompts_file(&slow, &[long, long, long]);
    std::fs::remove_file(&first).unwrap();
    let summary_file = out_dir.join("summary.json");
    let before = std::fs::read(&summary_file).unwrap();
    let output = crate::cli::interrupted_klein(batch_args(&prompts, &out_dir), || {
        std::fs::read(&summary_file).is_ok_and(|now| now != before)
    });
    assert_eq!(output.status.code(), Some(130), "{:?}", output.status);
    let summary = self::summary(&out_dir);
    assert_eq!(summary["interrupted"], true);
    assert_eq!(summary["totals"]["not_run"], 3, "{summary}");
}
