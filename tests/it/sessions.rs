//! Which graph sessions a pipeline keeps between its stages and its calls.

use klein::pipeline::{Generation, Pipeline, Request, Stage};

use crate::util::{repo, tiny_options, tiny_pipeline};

/// How many times a generation's timings list `stage`.
fn count(generation: &Generation, stage: Stage) -> usize {
    generation
        .timings
        .iter()
        .filter(|(timed, _)| *timed == stage)
        .count()
}

/// `with_release_transformer`: the transformer's session goes before each decode, so every call
/// loads it again (its timings list the load each time, where a pipeline that keeps it lists it
/// once), and the images are those of the pipeline that keeps it, byte for byte.
#[test]
fn a_released_transformer_loads_again_and_gives_the_same_images() {
    let request = Request::new("a red fox in the snow")
        .with_seed(5)
        .with_size(64, 48)
        .with_steps(2);
    let mut kept = tiny_pipeline();
    let options = tiny_options().with_release_transformer(true);
    let mut released = Pipeline::load(&repo().join("onnx/klein-tiny"), options).unwrap();
    for call in 0..2 {
        let expected = kept.generate(&request, None).unwrap();
        let generation = released.generate(&request, None).unwrap();
        assert_eq!(
            generation.images[0].pixels, expected.images[0].pixels,
            "call {call}"
        );
        assert_eq!(count(&generation, Stage::LoadTransformer), 1, "call {call}");
        let kept_loads = count(&expected, Stage::LoadTransformer);
        assert_eq!(kept_loads, usize::from(call == 0), "call {call}");
    }
}

/// An app that never takes the warnings does not grow them without end: a pipeline keeps the
/// newest 64 (each call here warns that guidance is ignored by the distilled model), and the first
/// warning taken says how many older ones were dropped.
#[test]
fn warnings_not_taken_are_kept_up_to_a_limit() {
    let request = Request::new("a red fox in the snow")
        .with_seed(5)
        .with_size(16, 16)
        .with_steps(1)
        .with_guidance(3.0);
    let mut pipeline = tiny_pipeline();
    for _ in 0..66 {
        pipeline.generate(&request, None).unwrap();
    }
    let warnings = pipeline.take_warnings();
    assert_eq!(warnings.len(), 65, "{:?}", &warnings[..2]);
    assert!(
        warnings[0].starts_with("2 earlier warning(s) dropped"),
        "{}",
        warnings[0]
    );
    assert!(warnings[1..]
        .iter()
        .all(|w| w.contains("guidance 3 is ignored")));
    assert!(pipeline.take_warnings().is_empty());
}
