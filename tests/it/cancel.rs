//! Cancellation through the Rust API: a progress callback that returns `ControlFlow::Break` ends
//! the generation with `KleinError::Cancelled`, and the same pipeline then generates normally.

use std::ops::ControlFlow;

use klein::pipeline::{Progress, Request, Stage};
use klein::KleinError;

use crate::util::tiny_pipeline;

/// For each cancel point (after denoising step 1 of 2; when decoding starts): the generation
/// returns `Cancelled` and no event after the cancel point reaches the callback; the next
/// generation on the same pipeline equals, byte for byte, that of a freshly loaded pipeline, and
/// its warnings are its own: not those the cancelled generation met (guidance given to the
/// distilled tiny model, which warns at the start).
#[test]
fn cancelled_generation_leaves_pipeline_usable() {
    let request = Request::new("a red fox in the snow")
        .with_seed(5)
        .with_size(64, 64)
        .with_steps(2);
    let fresh = tiny_pipeline().generate(&request, None).unwrap();

    for cancel_at in [
        Progress::Step { step: 1, total: 2 },
        Progress::StageStarted(Stage::Decode),
    ] {
        let mut pipeline = tiny_pipeline();
        let mut events = Vec::new();
        let mut callback = |event: Progress| {
            let stop = event == cancel_at;
            events.push(event);
            if stop {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        };
        let guided = request.clone().with_guidance(5.0);
        let result = pipeline.generate(&guided, Some(&mut callback));
        assert!(
            matches!(result, Err(KleinError::Cancelled)),
            "cancel at {cancel_at:?}: expected Cancelled, got {result:?}"
        );
        assert_eq!(
            events.last(),
            Some(&cancel_at),
            "events after the cancel point: {events:?}"
        );

        let again = pipeline.generate(&request, None).unwrap();
        let warnings = pipeline.take_warnings();
        assert!(
            warnings.is_empty(),
            "cancel at {cancel_at:?}: the next generation's warnings: {warnings:?}"
        );
        assert_eq!(again.images.len(), 1);
        assert!(
            again.images == fresh.images,
            "cancel at {cancel_at:?}: the next generation differs from a fresh pipeline's in {} of {} bytes",
            again.images[0].pixels.iter().zip(&fresh.images[0].pixels).filter(|(a, b)| a != b).count(),
            fresh.images[0].pixels.len()
        );
    }
}
