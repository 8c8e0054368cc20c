//! The fuzz targets: the entry points that read untrusted bytes, and the invariants their results
//! must satisfy. Shared by the fuzzer (`benches/fuzz.rs`, which includes this file) and the
//! regression test (`fuzz_regressions.rs`, which replays `tests/fixtures/fuzz/`).
//!
//! A target returns an [`Outcome`]; a panic (caught by the caller) or [`Outcome::Violation`] is a
//! crash. Every target is deterministic in its input, so a saved crash replays exactly.

use std::path::{Path, PathBuf};

use image::DynamicImage;
use klein::bundle::manifest::{Manifest, MANIFEST_FILE};
use klein::stages::latents::prepare_image_ids;
use klein::stages::reference::{
    decode_reference_bytes, preprocess_reference, ReferenceImage, ReferenceLimits,
};
use klein::stages::schedule::{compute_empirical_mu, schedule};
use klein::stages::tokenize::PaddingSide;
use klein::stages::tokenize::PromptTokenizer;

/// Every target, by the name used on the command line and as the folder of its inputs.
pub const TARGETS: [&str; 3] = ["manifest", "reference", "tokenizer"];

/// Side of the largest square the small-area reference limits let through without resizing, so
/// that the Lanczos path runs on every input larger than that.
const SMALL_AREA_SIDE: u64 = 96;

/// What one input did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Accepted; the string classifies the result (for the fuzzer's corpus).
    Accepted(String),
    /// Refused with an error; the string is its message.
    Refused(String),
    /// Accepted, but the result breaks an invariant: a bug.
    Violation(String),
}

/// The state the targets need: the bundled tokenizer under two specs (the manifest's right
/// padding to 512, and left padding to 16, which truncates most inputs).
pub struct Targets {
    tokenizers: Vec<PromptTokenizer>,
}

/// The repository root.
pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Where the saved inputs of `target` live: `tests/fixtures/fuzz/<target>/`.
pub fn corpus_dir(target: &str) -> PathBuf {
    repo().join("tests/fixtures/fuzz").join(target)
}

/// The seed inputs of `target` besides its corpus folder: the files the fuzzer starts from.
pub fn seed_files(target: &str) -> Vec<PathBuf> {
    let fixtures = repo().join("tests/fixtures");
    match target {
        "manifest" => vec![
            repo().join("onnx/klein-tiny").join(MANIFEST_FILE),
            fixtures.join("bundle_manifest.json"),
        ],
        "reference" => files_in(&fixtures.join("reference"))
            .into_iter()
            .chain(files_in(&fixtures.join("decode")))
            .filter(|p| {
                p.extension()
                    .is_some_and(|e| ["png", "jpg", "jpeg", "webp"].iter().any(|x| e == *x))
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// The plain files directly in `dir`, sorted (none when it does not exist).
pub fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

impl Targets {
    pub fn new() -> Result<Targets, String> {
        let bundle = repo().join("onnx/klein-tiny");
        let manifest = Manifest::load(&bundle).map_err(|e| format!("{e}"))?;
        let path = bundle.join(&manifest.tokenizer.file);
        let right = manifest.tokenizer.clone();
        let mut left = right.clone();
        left.padding_side = PaddingSide::Left;
        left.max_sequence_length = 16;
        let tokenizers = [right, left]
            .iter()
            .map(|spec| PromptTokenizer::load(&path, spec).map_err(|e| format!("{e}")))
            .collect::<Result<_, _>>()?;
        Ok(Targets { tokenizers })
    }

    /// Runs `target` on `input`. Panics are the caller's to catch.
    pub fn run(&self, target: &str, input: &[u8]) -> Outcome {
        match target {
            "manifest" => manifest(input),
            "reference" => reference(input),
            "tokenizer" => self.tokenizer(input),
            other => Outcome::Violation(format!("unknown target `{other}`")),
        }
    }

    /// The prompt is the input as UTF-8, invalid sequences replaced (as a caller decoding user
    /// text would), through each tokenizer spec.
    fn tokenizer(&self, input: &[u8]) -> Outcome {
        let prompt = String::from_utf8_lossy(input);
        let mut classes = Vec::new();
        for tokenizer in &self.tokenizers {
            let spec = tokenizer.spec();
            let encoded = match tokenizer.encode(&prompt) {
                Ok(encoded) => encoded,
                Err(e) => return refused(&e),
            };
            let max = spec.max_sequence_length;
            let (ids, mask) = (&encoded.input_ids, &encoded.attention_mask);
            if ids.len() != max || mask.len() != max {
                return Outcome::Violation(format!(
                    "{:?}/{max}: {} ids and {} mask values, expected {max} of each",
                    spec.padding_side,
                    ids.len(),
                    mask.len()
                ));
            }
            if mask.iter().any(|&m| m != 0 && m != 1) {
                return Outcome::Violation(format!("mask values other than 0 and 1: {mask:?}"));
            }
            let real = mask.iter().filter(|&&m| m == 1).count();
            // Real tokens are contiguous, on the side away from the padding.
            let expected_mask: Vec<i64> = match spec.padding_side {
                PaddingSide::Right => (0..max).map(|i| i64::from(i < real)).collect(),
                PaddingSide::Left => (0..max).map(|i| i64::from(i >= max - real)).collect(),
            };
            if *mask != expected_mask {
                return Outcome::Violation(format!(
                    "{:?} padding: the mask is not {real} ones on one side: {mask:?}",
                    spec.padding_side
                ));
            }
            let pad = i64::from(spec.pad_token_id);
            if ids.iter().zip(mask).any(|(&id, &m)| m == 0 && id != pad) {
                return Outcome::Violation(format!(
                    "a padded position is not the pad id {pad}: {ids:?}"
                ));
            }
            if encoded.truncated && real != max {
                return Outcome::Violation(format!(
                    "truncated, yet only {real} of {max} tokens are real"
                ));
            }
            if real == 0 {
                return Outcome::Violation("no real token: even the template is gone".to_string());
            }
            // The number of real tokens, to a power of two.
            classes.push(format!(
                "{:?}:{}",
                spec.padding_side,
                real.next_power_of_two()
            ));
        }
        Outcome::Accepted(classes.join(" "))
    }
}

/// `Manifest::from_json_bytes`; an accepted manifest must then be usable by the stages that do
/// arithmetic with its numbers (schedule, reference ids, reference preprocessing).
fn manifest(input: &[u8]) -> Outcome {
    let manifest = match Manifest::from_json_bytes(input, Path::new("fuzz/manifest.json")) {
        Ok(m) => m,
        Err(e) => return refused(&e),
    };
    let multiple = manifest.latents.pixel_multiple;
    if multiple == 0 || manifest.latents.channels == 0 {
        return Outcome::Violation(format!(
            "accepted latents.pixel_multiple {multiple} and latents.channels {}: the pipeline divides \
             sizes by the first and allocates tensors of the second",
            manifest.latents.channels
        ));
    }
    if manifest.tokenizer.max_sequence_length == 0 || manifest.model.default_steps == 0 {
        return Outcome::Violation("accepted a zero max_sequence_length or default_steps".into());
    }
    // The schedule of the default steps at the smallest and the largest output.
    let steps = (manifest.model.default_steps as usize).min(1000);
    for image_tokens in [1, klein::limits::MAX_IMAGE_TOKENS] {
        let mu = compute_empirical_mu(&manifest.scheduler.empirical_mu, image_tokens, steps);
        if let Ok(s) = schedule(steps, mu, &manifest.scheduler.shift) {
            if s.sigmas.iter().chain(&s.timesteps).any(|v| !v.is_finite()) {
                return Outcome::Violation(format!(
                    "the schedule of {steps} steps for {image_tokens} tokens has non-finite sigmas \
                     (mu {mu}): {:?}",
                    s.sigmas
                ));
            }
        }
    }
    // Reference position ids for the most references the token budget admits.
    let side = (manifest.references.limits.min_side.max(1) / multiple).max(1) as usize;
    let most = klein::limits::MAX_IMAGE_TOKENS / (side * side);
    let ids = prepare_image_ids(&[(1, 1), (1, 1)], manifest.references.time_offset_scale);
    if ids.nrows() != 2 {
        return Outcome::Violation(format!(
            "2 one-token references gave {} id rows",
            ids.nrows()
        ));
    }
    let last = manifest
        .references
        .time_offset_scale
        .checked_mul(most as i64 + 1);
    if last.is_none() {
        return Outcome::Violation(format!(
            "references.time_offset_scale {} overflows the time coordinate of reference {most}",
            manifest.references.time_offset_scale
        ));
    }
    // A plain image through the accepted reference limits.
    let image = DynamicImage::new_rgb8(200, 120);
    let limits = &manifest.references.limits;
    if let Ok(r) = preprocess_reference(&image, limits, multiple, Path::new("fuzz.png")) {
        if let Some(problem) = reference_problem(&r, limits, multiple) {
            return Outcome::Violation(problem);
        }
    }
    Outcome::Accepted("manifest".into())
}

/// `decode_reference_bytes` under the default limits and under a small `max_area` (which sends
/// most inputs through the Lanczos resize).
fn reference(input: &[u8]) -> Outcome {
    let small = ReferenceLimits {
        max_area: SMALL_AREA_SIDE * SMALL_AREA_SIDE,
        ..ReferenceLimits::default()
    };
    let mut classes = Vec::new();
    for limits in [ReferenceLimits::default(), small] {
        match decode_reference_bytes(input, &limits, 16, Path::new("fuzz.png")) {
            Ok(r) => {
                if let Some(problem) = reference_problem(&r, &limits, 16) {
                    return Outcome::Violation(problem);
                }
                classes.push("ok");
            }
            Err(e) => return refused(&e),
        }
    }
    Outcome::Accepted(classes.join("+"))
}

/// What is wrong with a reference the preprocessing accepted, if anything: its tensor must be
/// `[1, 3, height, width]` with sides multiples of `multiple`, at most `max_area` pixels (or one
/// multiple-sized tile when the area is smaller than that), and values in [-1, 1].
pub fn reference_problem(
    r: &ReferenceImage,
    limits: &ReferenceLimits,
    multiple: u32,
) -> Option<String> {
    let shape = [1, 3, r.height as usize, r.width as usize];
    if r.pixels.shape() != shape {
        return Some(format!(
            "tensor shape {:?} for a {}x{} reference",
            r.pixels.shape(),
            r.width,
            r.height
        ));
    }
    if r.width == 0
        || r.height == 0
        || !r.width.is_multiple_of(multiple)
        || !r.height.is_multiple_of(multiple)
    {
        return Some(format!(
            "size {}x{} is not a non-zero multiple of {multiple}",
            r.width, r.height
        ));
    }
    let area = u64::from(r.width) * u64::from(r.height);
    if area
        > limits
            .max_area
            .max(u64::from(multiple) * u64::from(multiple))
    {
        return Some(format!(
            "size {}x{} is over max_area {}",
            r.width, r.height, limits.max_area
        ));
    }
    if let Some(v) = r.pixels.iter().find(|v| !(-1.0..=1.0).contains(*v)) {
        return Some(format!("pixel value {v} outside [-1, 1]"));
    }
    None
}

/// A refusal, with the error's whole message.
fn refused(error: &klein::KleinError) -> Outcome {
    Outcome::Refused(error.to_string())
}
