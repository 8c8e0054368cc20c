//! The one recipe from a front end's [`RequestSpec`] to a ready request ([`Pipeline::prepare`]):
//! what every front end now shares. Each test is one place where the front ends used to differ.
use klein::limits::MAX_REFERENCES;
use klein::pipeline::{ImageInput, Input, RequestSpec, Rule, RANDOM_SEED_LIMIT};

use crate::cli::png_header_only;
use crate::util::{repo, tiny_pipeline};

fn gray() -> ImageInput {
    ImageInput::file(repo().join("tests/fixtures/reference/gray.png"))
}

/// Headers before pixels (the server used to decode every upload first): two files that declare
/// 2048x2048 and hold no pixels are refused for the token budget (2048x2048 output: 16,384 tokens,
/// plus 4,096 per reference once downscaled to 1 MP; at most 20,480), not for their data. With a
/// small output they fit, and the first one's data is what fails, naming that input.
#[test]
fn prepare_checks_headers_and_the_token_budget_before_decoding() {
    let pipeline = tiny_pipeline();
    let empty = |name: &str| ImageInput::encoded(png_header_only(2048, 2048), name);
    let mut spec = RequestSpec::new("a fox");
    (spec.width, spec.height) = (Some(2048), Some(2048));
    spec.references = vec![empty("a.png"), empty("b.png")];
    let error = pipeline.prepare(&spec).unwrap_err();
    assert_eq!(
        (error.error.param(), error.input),
        (Some("width"), None),
        "{error}"
    );
    assert!(error.to_string().contains("24576 image tokens"), "{error}");
    (spec.width, spec.height) = (Some(64), Some(64));
    let error = pipeline.prepare(&spec).unwrap_err();
    assert_eq!(error.input, Some(Input::Reference(0)), "{error}");
    assert!(error.to_string().contains("a.png"), "{error}");
}

/// Numbers and rules before any file is read; the reference count includes the source; the
/// rules between the inpainting fields are typed, for each front end to word in its own names.
#[test]
fn numbers_and_rules_come_before_files() {
    let pipeline = tiny_pipeline();
    let missing = ImageInput::file("/nonexistent/source.png");
    let mut spec = RequestSpec::new("a fox");
    spec.source = Some(missing.clone());
    spec.steps = Some(0);
    let error = pipeline.prepare(&spec).unwrap_err();
    assert_eq!(error.error.param(), Some("steps"), "{error}");
    spec.steps = None;
    spec.strength = Some(1.5);
    assert_eq!(spec.check().unwrap_err().error.param(), Some("strength"));
    spec.strength = None;
    spec.mask_crop = Some(8);
    let error = spec.check().unwrap_err();
    assert_eq!(error.rule, Some(Rule::MaskCropNeedsMask), "{error}");
    spec.source = None;
    spec.mask_crop = None;
    spec.mask = Some(gray());
    assert_eq!(spec.check().unwrap_err().rule, Some(Rule::NeedsSource));
    let mut spec = RequestSpec::new("a fox");
    spec.source = Some(gray());
    spec.references = vec![gray(); MAX_REFERENCES];
    let error = spec.check().unwrap_err();
    assert_eq!(error.error.param(), Some("references"), "{error}");
    // Files last: the missing source, named as the source.
    let mut spec = RequestSpec::new("a fox");
    spec.source = Some(missing);
    let error = spec.check().unwrap_err();
    assert_eq!(error.input, Some(Input::Source), "{error}");
}

/// No seed: one below 2^53 (the CLI and the server kept that bound; Python and Ray drew 63 bits);
/// a given seed is kept. The source sets the size, its default strength is klein's (1.0), and the
/// references load at the source's size.
#[test]
fn prepare_draws_seeds_below_2_53_and_applies_the_inpaint_defaults() {
    let pipeline = tiny_pipeline();
    let mut spec = RequestSpec::new("a fox");
    spec.source = Some(gray());
    spec.references = vec![gray()];
    let seeds: Vec<u64> = (0..64)
        .map(|_| pipeline.prepare(&spec).unwrap().seed)
        .collect();
    assert!(seeds.iter().all(|&s| s < RANDOM_SEED_LIMIT), "{seeds:?}");
    assert!(seeds.windows(2).any(|w| w[0] != w[1]), "{seeds:?}");
    spec.seed = Some(u64::MAX);
    let request = pipeline.prepare(&spec).unwrap();
    assert_eq!(request.seed, u64::MAX);
    let inpaint = request.inpaint.as_ref().unwrap();
    assert_eq!(inpaint.strength, 1.0);
    assert!(inpaint.mask.is_none(), "no mask: img2img");
    let source = (inpaint.image.width, inpaint.image.height);
    let reference = (request.references[0].width, request.references[0].height);
    assert_eq!(source, reference);
    assert_eq!(pipeline.output_size(&request).unwrap(), source);
}
