//! Every number a user gives is bounded (`src/limits.rs`), checked before anything is loaded, and
//! refused with a message that names the bound: through the CLI (exit 2, no output), batch lines
//! (the line fails, the others run), and the C API (`KLEIN_ERROR_USER`, the process lives).

use std::ptr;

use klein::capi::{
    klein_pipeline_free, klein_pipeline_load, KleinOptions, KleinPipeline, KleinRequest,
    KleinStatus,
};
use klein::limits::{
    MAX_BATCH_LINES, MAX_CPU_CACHE_GIB, MAX_GUIDANCE, MAX_IMAGE_TOKENS, MAX_PROMPT_BYTES,
    MAX_PROMPT_CACHE_MIB, MAX_REFERENCES, MAX_SIDE, MAX_STEPS, MAX_THREADS,
};

use crate::capi::{c_paths, call, cpu_options, generate_into};
use crate::cli::{assert_refused, generate, klein, path_str, FAST};
use crate::util::{assert_mentions, temp_dir};

/// Each number past its bound, with `-m` naming a bundle that does not exist: the bound is named,
/// so it was checked before the bundle was opened.
#[test]
fn numbers_past_their_bounds_are_refused_before_the_bundle_is_read() {
    let steps = format!("between 1 and {MAX_STEPS}");
    let threads = format!("between 1 and {MAX_THREADS}");
    let guidance = format!("between 0 and {MAX_GUIDANCE}");
    let side = format!("between 16 and {MAX_SIDE}");
    let cases: Vec<(Vec<String>, Vec<String>)> = vec![
        (
            vec!["--steps".into(), "100000000000".into()],
            vec![steps.clone()],
        ),
        (
            vec!["--steps".into(), (MAX_STEPS + 1).to_string()],
            vec![steps.clone()],
        ),
        (vec!["--steps".into(), "0".into()], vec![steps]),
        (
            vec!["--threads".into(), "100000".into()],
            vec![threads.clone()],
        ),
        (vec!["--threads".into(), "0".into()], vec![threads]),
        (
            vec![
                "--prompt-cache".into(),
                "/no/such/cache".into(),
                "--prompt-cache-max-mib".into(),
                (MAX_PROMPT_CACHE_MIB + 1).to_string(),
            ],
            vec![format!("between 1 and {MAX_PROMPT_CACHE_MIB}")],
        ),
        (
            vec![
                "--cpu-cache".into(),
                "/no/such/cache".into(),
                "--cpu-cache-max-gib".into(),
                "0".into(),
            ],
            vec![format!("between 1 and {MAX_CPU_CACHE_GIB}")],
        ),
        (
            vec!["--guidance".into(), "1e9".into()],
            vec![guidance.clone()],
        ),
        (
            vec!["--guidance".into(), "NaN".into()],
            vec![guidance.clone()],
        ),
        // A negative number is a value, not a flag: its bound is named.
        (vec!["--guidance".into(), "-0.1".into()], vec![guidance]),
        (vec!["--width".into(), "5000".into()], vec![side.clone()]),
        (vec!["--height".into(), "0".into()], vec![side]),
    ];
    for (flags, needles) in cases {
        let mut extra: Vec<&str> = vec!["-m", "/no/such/bundle"];
        extra.extend(flags.iter().map(String::as_str));
        let needles: Vec<&str> = needles.iter().map(String::as_str).collect();
        let run = assert_refused(&extra, &needles);
        assert!(
            !run.stderr.contains("/no/such/bundle"),
            "checked after opening the bundle:\n{}",
            run.describe()
        );
    }
}

/// Eleven references that do not exist: the count is refused before any file is read.
#[test]
fn too_many_references_are_refused_before_any_is_read() {
    let mut extra: Vec<String> = FAST.iter().map(|s| s.to_string()).collect();
    for i in 0..=MAX_REFERENCES {
        extra.extend(["--ref".to_string(), format!("/no/such/ref{i}.png")]);
    }
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let run = assert_refused(
        &extra,
        &[&format!(
            "{} reference images: at most {MAX_REFERENCES}",
            MAX_REFERENCES + 1
        )],
    );
    assert!(!run.stderr.contains("ref0.png"), "{}", run.describe());
}

#[test]
fn an_overlong_prompt_is_refused() {
    let out_dir = temp_dir("limits-prompt");
    let prompt = "a".repeat(MAX_PROMPT_BYTES + 1);
    let run = generate(&prompt, &out_dir.join("out.png"), &FAST);
    run.assert_user_error(&[&format!("at most {MAX_PROMPT_BYTES} are accepted")]);
}

/// A batch line with an absurd step count fails alone; the batch, and its rerun, go on.
#[test]
fn a_batch_line_past_a_bound_fails_alone() {
    let dir = temp_dir("limits-batch");
    let prompts = dir.join("p.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt\": \"a\", \"seed\": 1}\n{\"prompt\": \"b\", \"steps\": 100000000000}\n",
    )
    .unwrap();
    let out_dir = dir.join("out");
    for attempt in 0..2 {
        let mut args = vec!["generate", "--prompts", path_str(&prompts), "--out-dir"];
        args.push(path_str(&out_dir));
        args.extend(FAST);
        let run = klein(args);
        assert_eq!(run.code, Some(2), "attempt {attempt}:\n{}", run.describe());
        assert!(!run.stderr.contains("panicked"), "{}", run.describe());
        assert_mentions(&run.stderr, &[&format!("line 2 (0002): invalid request: steps is 100000000000: it must be between 1 and {MAX_STEPS}")]);
        assert!(out_dir.join("0001.png").is_file(), "{}", run.describe());
    }
}

#[test]
fn a_batch_file_with_too_many_lines_is_refused() {
    let dir = temp_dir("limits-batch-lines");
    let prompts = dir.join("p.jsonl");
    std::fs::write(
        &prompts,
        "{\"prompt\": \"a\"}\n".repeat(MAX_BATCH_LINES + 1),
    )
    .unwrap();
    let run = klein([
        "generate",
        "--prompts",
        path_str(&prompts),
        "--out-dir",
        path_str(&dir.join("out")),
    ]);
    run.assert_user_error(&[&format!("at most {MAX_BATCH_LINES} run in one batch")]);
    assert!(!dir.join("out").join("0001.png").exists());
}

/// `--help` states the bounds of `src/limits.rs`, not other numbers.
#[test]
fn help_states_the_real_limits() {
    let run = klein(["generate", "--help"]);
    assert_eq!(run.code, Some(0), "{}", run.describe());
    let help = run.stdout.split_whitespace().collect::<Vec<_>>().join(" ");
    for needle in [
        format!("16 to {MAX_SIDE}"),
        format!("at most {MAX_IMAGE_TOKENS}"),
        format!("Denoising steps, 1 to {MAX_STEPS}"),
        format!("0 to {MAX_GUIDANCE}"),
        format!("1 to {MAX_THREADS}"),
        format!("at most {MAX_REFERENCES}"),
    ] {
        assert!(help.contains(&needle), "--help lacks `{needle}`:\n{help}");
    }
}

/// Through the C API: `steps = UINT32_MAX` and 100000 threads are user errors, the host lives.
#[test]
fn the_c_api_refuses_numbers_past_their_bounds() {
    let (bundle, library) = c_paths();
    let options = cpu_options(&library, 100_000);
    let mut pipeline: *mut KleinPipeline = ptr::null_mut();
    // SAFETY (every call): valid or NULL pointers, NUL-terminated strings, a live pipeline.
    let (status, message) =
        call(|m| unsafe { klein_pipeline_load(bundle.as_ptr(), &options, &mut pipeline, m) });
    assert_eq!(status, KleinStatus::KLEIN_ERROR_USER, "{message}");
    assert_mentions(&message, &[&format!("between 1 and {MAX_THREADS}")]);
    assert!(pipeline.is_null());

    let options = KleinOptions {
        threads: 1,
        ..options
    };
    let (status, message) =
        call(|m| unsafe { klein_pipeline_load(bundle.as_ptr(), &options, &mut pipeline, m) });
    assert_eq!(status, KleinStatus::KLEIN_OK, "{message}");
    let request = KleinRequest {
        prompt: c"a cat".as_ptr(),
        seed: 1,
        width: 64,
        height: 64,
        steps: u32::MAX,
        guidance: 0.0,
        num_images: 0,
        reference_paths: ptr::null(),
        reference_count: 0,
        negative_prompt: std::ptr::null(),
        image_path: std::ptr::null(),
        mask_path: std::ptr::null(),
        strength: 0.0,
        preview_every: 0,
        preview: None,
        preview_user_data: std::ptr::null_mut(),
        mask_crop: 0,
        mask_crop_padding: 0,
    };
    let mut buffer = vec![0u8; 64 * 64 * 4];
    let (status, message) = call(|m| unsafe { generate_into(pipeline, &request, &mut buffer, m) });
    assert_eq!(status, KleinStatus::KLEIN_ERROR_USER, "{message}");
    assert_mentions(
        &message,
        &[&format!(
            "steps is {}: it must be between 1 and {MAX_STEPS}",
            u32::MAX
        )],
    );
    unsafe { klein_pipeline_free(pipeline) };
}

/// `Request::check_bounds` names the field of each number out of bounds in the error itself
/// (`KleinError::param`), which the Python bindings and the server report as the argument: no
/// API reads it from the message.
#[test]
fn request_errors_name_their_field() {
    use klein::pipeline::Request;
    let long = "x".repeat(MAX_PROMPT_BYTES + 1);
    let base = || Request::new("a fox");
    let with = |change: &dyn Fn(&mut Request)| {
        let mut request = base();
        change(&mut request);
        request
    };
    let cases: Vec<(Request, &str)> = vec![
        (base().with_num_images(0), "num_images"),
        (base().with_steps(0), "steps"),
        (base().with_guidance(f64::NAN), "guidance"),
        (with(&|r| r.preview_every = Some(0)), "preview_every"),
        (Request::new(long.as_str()), "prompt"),
        (
            base().with_negative_prompt(long.as_str()),
            "negative_prompt",
        ),
        (with(&|r| r.width = Some(MAX_SIDE + 16)), "width"),
        (with(&|r| r.height = Some(8)), "height"),
        // Both sides in bounds, their tokens past the budget: the output's size, as `width`.
        (base().with_size(MAX_SIDE, MAX_SIDE), "width"),
    ];
    assert!(MAX_SIDE / 16 * (MAX_SIDE / 16) > MAX_IMAGE_TOKENS as u32);
    for (request, field) in cases {
        let error = request.check_bounds().expect_err(field);
        assert_eq!(error.param(), Some(field), "{error}");
    }
    assert_eq!(base().check_bounds().map_err(|e| e.to_string()), Ok(()));
}

/// Given embeddings or initial latents with a NaN or an infinity are refused before the
/// denoising, naming the field, the count and the first bad value (they made an all-black image,
/// reported only as non-finite latents); the same tensors made finite generate.
#[test]
fn given_tensors_must_be_finite() {
    use klein::pipeline::Request;
    use ndarray::Array4;
    let mut pipeline = crate::util::tiny_pipeline();
    let embeds = pipeline.encode_prompt("a fox", None).unwrap();
    let base = || Request::new("a fox").with_size(64, 64).with_steps(2);
    let mut bad_embeds = embeds.clone();
    bad_embeds.embeds[[0, 3, 5]] = f32::NAN;
    bad_embeds.embeds[[0, 7, 1]] = f32::INFINITY;
    let error = pipeline
        .generate(&base().with_prompt_embeds(bad_embeds), None)
        .unwrap_err();
    assert_eq!(error.param(), Some("prompt_embeds"), "{error}");
    assert_mentions(
        &error.to_string(),
        &[
            "prompt embeddings hold 2 NaN or infinite value(s)",
            "the first, NaN",
        ],
    );
    let mut latents = Array4::<f32>::zeros((1, 128, 4, 4));
    latents[[0, 9, 2, 3]] = f32::NEG_INFINITY;
    let error = pipeline
        .generate(&base().with_initial_latents(latents.clone()), None)
        .unwrap_err();
    assert_eq!(error.param(), Some("initial_latents"), "{error}");
    assert_mentions(
        &error.to_string(),
        &[
            "initial latents hold 1 NaN or infinite",
            "-inf",
            "flat index 155",
        ],
    );
    latents[[0, 9, 2, 3]] = 0.5;
    let request = base()
        .with_initial_latents(latents)
        .with_prompt_embeds(embeds);
    pipeline.generate(&request, None).unwrap();
}

/// A size out of range that nobody gave is the image's: the message says so (it read as a width
/// the request had asked for).
#[test]
fn a_size_taken_from_an_image_says_so() {
    let dir = temp_dir("limits-image-size");
    let wide = dir.join("wide.png");
    image::RgbImage::from_pixel(6000, 64, image::Rgb([10, 200, 30]))
        .save(&wide)
        .unwrap();
    let out = dir.join("out.png");
    let run = generate(
        "a fox",
        &out,
        &[
            "--image",
            path_str(&wide),
            "--strength",
            "0.5",
            "--steps",
            "1",
        ],
    );
    run.assert_user_error(&[
        "width 6000 (the source or first reference image's, as no size was given",
        "between 16 and 4096 pixels",
    ]);
}
