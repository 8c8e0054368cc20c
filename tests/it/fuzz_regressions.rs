//! Replays every saved fuzz input (`tests/fixtures/fuzz/<target>/`: the crashes `cargo bench
//! --bench fuzz` found, which are fixed, and hand-made hostile inputs) through the fuzz targets of
//! `fuzz_targets.rs`: none may panic or break an invariant. The seed inputs the fuzzer starts from
//! are replayed too.

use std::panic::{self, AssertUnwindSafe};

use crate::fuzz_targets::{corpus_dir, files_in, seed_files, Outcome, Targets, TARGETS};

/// Inputs each target's folder must hold at least: the folders are what makes this test mean
/// something, so an emptied one fails it.
const MIN_SAVED_INPUTS: usize = 4;

#[test]
fn saved_fuzz_inputs_neither_panic_nor_break_invariants() {
    let targets = Targets::new().unwrap();
    let mut failures = Vec::new();
    let mut replayed = 0;
    for target in TARGETS {
        let saved: Vec<_> = files_in(&corpus_dir(target))
            .into_iter()
            .filter(|p| p.extension().is_none_or(|e| e != "md"))
            .collect();
        assert!(
            saved.len() >= MIN_SAVED_INPUTS,
            "{} holds {} inputs, expected at least {MIN_SAVED_INPUTS}",
            corpus_dir(target).display(),
            saved.len()
        );
        for path in saved.iter().chain(&seed_files(target)) {
            let input = std::fs::read(path).unwrap();
            replayed += 1;
            match panic::catch_unwind(AssertUnwindSafe(|| targets.run(target, &input))) {
                Ok(Outcome::Violation(problem)) => {
                    failures.push(format!("{target} {}: {problem}", path.display()))
                }
                Ok(_) => {}
                Err(_) => {
                    failures.push(format!("{target} {}: panicked (see above)", path.display()))
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {replayed} inputs failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The hand-made inputs are refused with a message, not accepted: a huge declared PNG size is
/// refused before decoding, a truncated PNG is reported as such, deep nesting and out-of-range
/// numbers in a manifest are schema errors; numbers the pipeline cannot use (a sequence length
/// past the limit, no heads, a zero tile) and another scheduler are refused by name.
#[test]
fn hostile_inputs_are_refused_with_a_reason() {
    let targets = Targets::new().unwrap();
    for (target, file, needle) in [
        (
            "reference",
            "huge-declared-size.png",
            "larger than this runtime decodes",
        ),
        ("reference", "truncated.png", "cannot decode"),
        // Pillow refuses both ("broken data stream"): zlib's Adler-32 of the image data.
        ("reference", "bad-adler32.png", "cannot decode"),
        ("reference", "changed-idat-byte.png", "cannot decode"),
        ("reference", "zero-size.png", "cannot decode"),
        ("manifest", "deeply-nested.json", "recursion limit exceeded"),
        ("manifest", "nan-number.json", "not valid JSON"),
        (
            "manifest",
            "negative-size.json",
            "invalid value: integer `-16`",
        ),
        (
            "manifest",
            "huge-numbers.json",
            "embed_dim 48 != hidden_size 18446744073709551615 x 3 hidden layers (overflows)",
        ),
        (
            "manifest",
            "time-offset-overflow.json",
            "time_offset_scale 9223372036854775807 is out of range",
        ),
        (
            "manifest",
            "float-version.json",
            "format_version 1.5 is not supported",
        ),
        ("manifest", "empty.json", "not valid JSON: EOF"),
        (
            "manifest",
            "huge-sequence-length.json",
            "max_sequence_length 100000000 is outside 1..=8192",
        ),
        (
            "manifest",
            "other-scheduler.json",
            "scheduler.class \"DDIMScheduler\" is not \"FlowMatchEulerDiscreteScheduler\"",
        ),
        (
            "manifest",
            "zero-heads.json",
            "num_attention_heads 0 and attention_head_dim 32 must be non-zero",
        ),
        ("manifest", "zero-sample-size.json", "vae.sample_size is 0"),
        (
            "manifest",
            "zero-aspect-ratio.json",
            "references.max_aspect_ratio 0, max_area 1048576 and min_side 64 must be at least 1",
        ),
        ("reference", "one-pixel.png", "too small: 1x1"),
        (
            "reference",
            "extreme-aspect.png",
            "aspect ratio too extreme: 1024x64",
        ),
        ("reference", "gif-signature.gif", "unsupported image"),
    ] {
        let input = std::fs::read(corpus_dir(target).join(file)).unwrap();
        match targets.run(target, &input) {
            Outcome::Refused(reason) => assert!(
                reason.contains(needle),
                "{target}/{file}: expected the refusal to mention `{needle}`, got: {reason}"
            ),
            other => panic!("{target}/{file}: expected a refusal, got {other:?}"),
        }
    }
}
