//! One pipeline per thread (the threading model of `src/pipeline.rs`): pipelines loaded and run in
//! parallel threads give exactly the images that one pipeline gives running the same requests in
//! turn, and `Pipeline` is `Send`.

use klein::pipeline::{Pipeline, Request, Stage};

use crate::util::tiny_pipeline;

/// Compile-time check: a `Pipeline` can move to another thread (the C API relies on it too).
#[test]
fn pipeline_is_send() {
    fn assert_send<T: Send>() {}
    assert_send::<Pipeline>();
}

/// Four requests (two prompts, two sizes, four seeds; 2 steps). Compares, byte for byte, the RGB
/// images of one pipeline running all four in turn with those of two threads, each loading its
/// own pipeline at the same time and running every other request.
#[test]
fn parallel_pipelines_match_sequential() {
    let requests: Vec<Request> = [
        (1, "a red fox in the snow", 64, 64),
        (2, "a lighthouse at dusk", 48, 32),
    ]
    .into_iter()
    .cycle()
    .take(4)
    .enumerate()
    .map(|(i, (seed, prompt, w, h))| {
        Request::new(prompt)
            .with_seed(seed + 10 * i as u64)
            .with_size(w, h)
            .with_steps(2)
    })
    .collect();

    let mut sequential_pipeline = tiny_pipeline();
    let sequential: Vec<Vec<u8>> = requests
        .iter()
        .map(|r| {
            sequential_pipeline
                .generate(r, None)
                .unwrap()
                .images
                .remove(0)
                .pixels
        })
        .collect();

    let mut parallel: Vec<(usize, Vec<u8>)> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..2)
            .map(|thread| {
                let requests = &requests;
                scope.spawn(move || {
                    let mut pipeline = tiny_pipeline();
                    (thread..requests.len())
                        .step_by(2)
                        .map(|i| {
                            (
                                i,
                                pipeline
                                    .generate(&requests[i], None)
                                    .unwrap()
                                    .images
                                    .remove(0)
                                    .pixels,
                            )
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    parallel.sort_by_key(|(i, _)| *i);

    assert_eq!(parallel.len(), sequential.len());
    for ((i, got), want) in parallel.iter().zip(&sequential) {
        let differing = got.iter().zip(want).filter(|(a, b)| a != b).count();
        assert!(
            got.len() == want.len() && differing == 0,
            "request {i} ({:?}, seed {}): {differing} of {} bytes differ between the parallel and the sequential run",
            requests[*i].prompt,
            requests[*i].seed,
            want.len()
        );
    }
}

/// On the CPU the transformer loads on a thread of its own while the prompt is encoded (the tiny
/// bundle fits in memory). Its image equals, byte for byte, that of a pipeline whose graphs were
/// all loaded before the request, and its load is reported once, after the prompt's encoding.
#[test]
fn a_transformer_loaded_beside_the_text_encoder_gives_the_same_image() {
    let request = Request::new("a red fox in the snow")
        .with_seed(3)
        .with_size(64, 48)
        .with_steps(2);
    let mut preloaded = tiny_pipeline();
    preloaded.load_all_graphs().unwrap();
    let expected = preloaded.generate(&request, None).unwrap();

    let generation = tiny_pipeline().generate(&request, None).unwrap();
    assert_eq!(generation.images[0].pixels, expected.images[0].pixels);
    let stages: Vec<Stage> = generation.timings.iter().map(|(stage, _)| *stage).collect();
    let at = |wanted: Stage| {
        let found: Vec<usize> = (0..stages.len()).filter(|&i| stages[i] == wanted).collect();
        assert_eq!(found.len(), 1, "{wanted:?} in {stages:?}");
        found[0]
    };
    assert!(at(Stage::EncodePrompt) < at(Stage::LoadTransformer));
    assert!(at(Stage::LoadTransformer) < at(Stage::Denoise));
}
