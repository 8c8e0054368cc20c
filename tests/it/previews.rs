//! Step previews: the events the library sends (`Request::with_previews`), what they hold, their
//! cost-free absence when not asked, the CLI's `--preview` files, and bundles without a preview
//! map.
use std::ops::ControlFlow;

use klein::pipeline::{Progress, Request, StepPreview};
use klein::stages::latents::pack_latents;
use klein::stages::preview::preview_image;

use crate::cli::{edit_manifest, klein, path_str, read_png, BundleCopy};
use crate::util::{assert_mentions, temp_dir, tiny_pipeline};

/// Runs `request` and returns its previews and the number of steps reported.
fn previews_of(request: &Request) -> (Vec<StepPreview>, usize, klein::pipeline::Generation) {
    let mut pipeline = tiny_pipeline();
    let mut previews = Vec::new();
    let mut steps = 0;
    let mut on_event = |event: Progress| {
        match event {
            Progress::Preview(preview) => previews.push((*preview).clone()),
            Progress::Step { .. } => steps += 1,
            _ => {}
        }
        ControlFlow::Continue(())
    };
    let generation = pipeline.generate(request, Some(&mut on_event)).unwrap();
    (previews, steps, generation)
}

/// Every 2 of 5 steps and after the last: steps 2, 4, 5, each with both images of the batch at
/// 1/8 of the output's side. The last estimate is the final latents themselves (sigma after the
/// last step is 0), so its preview is the preview of what the decoder gets, within a level.
#[test]
fn previews_come_every_n_steps_and_end_on_the_final_latents() {
    let request = Request::new("a lighthouse")
        .with_seed(4)
        .with_size(64, 48)
        .with_steps(5)
        .with_num_images(2)
        .with_previews(2);
    let (previews, steps, generation) = previews_of(&request);
    assert_eq!(steps, 5);
    let at: Vec<(usize, usize)> = previews.iter().map(|p| (p.step, p.total)).collect();
    assert_eq!(at, vec![(2, 5), (4, 5), (5, 5)]);
    for preview in &previews {
        assert_eq!(preview.images.len(), 2);
        assert_eq!(preview.first_image, 0);
        for image in &preview.images {
            assert_eq!((image.width, image.height), (8, 6));
        }
    }
    assert_ne!(
        previews[0].images[0], previews[0].images[1],
        "two seeds' images differ"
    );

    // The final latents: denoise the same request step by step with the public stages.
    let mut pipeline = tiny_pipeline();
    let embeds = pipeline.encode_prompt("a lighthouse", None).unwrap();
    let references = klein::pipeline::ReferenceTokens::none(128);
    let schedule = pipeline.schedule(5, 3, 4).unwrap();
    let ctx = pipeline
        .denoise_context(2, 3, 4, &embeds, None, &references, schedule)
        .unwrap();
    let noise = pipeline.prepare_latents(4, 2, 64, 48);
    let latents = pipeline
        .denoise(pack_latents(noise.view()), &ctx, None)
        .unwrap();
    let spec = pipeline.manifest().preview.clone().unwrap();
    let last = previews.last().unwrap();
    for (i, image) in last.images.iter().enumerate() {
        let want = preview_image(latents.index_axis(ndarray::Axis(0), i), 3, 4, &spec);
        let worst = image
            .pixels
            .iter()
            .zip(&want.pixels)
            .map(|(a, b)| a.abs_diff(*b))
            .max()
            .unwrap();
        assert!(
            worst <= 1,
            "image {i}: preview of the final latents differs by {worst}"
        );
    }
    // Previews change nothing in the images.
    let (none, _, plain) = previews_of(
        &Request::new("a lighthouse")
            .with_seed(4)
            .with_size(64, 48)
            .with_steps(5)
            .with_num_images(2),
    );
    assert!(none.is_empty());
    assert_eq!(plain.images, generation.images);
}

/// `--preview FILE --preview-every 2` leaves the last preview in FILE (a 1/8-size PNG saying its
/// step); a non-PNG name and a bundle without a preview map are refused with exit code 2.
#[test]
fn cli_writes_preview_files_and_refuses_what_it_cannot_preview() {
    let dir = temp_dir("preview-cli");
    let preview = dir.join("p.png");
    let out = dir.join("o.png");
    let run = klein([
        "generate",
        "an owl",
        "--width",
        "64",
        "--height",
        "64",
        "--seed",
        "2",
        "-o",
        path_str(&out),
        "--preview",
        path_str(&preview),
        "--preview-every",
        "2",
        "--quiet",
    ]);
    assert_eq!(run.code, Some(0), "{}", run.describe());
    let png = read_png(&preview);
    assert_eq!((png.width, png.height), (8, 8));
    assert_eq!(png.text.get("step").map(String::as_str), Some("4/4"));

    let run = klein([
        "generate",
        "an owl",
        "-o",
        path_str(&dir.join("x.png")),
        "--preview",
        path_str(&dir.join("p.jpg")),
    ]);
    assert_eq!(run.code, Some(2), "{}", run.describe());
    assert_mentions(&run.stderr, &["p.jpg", "give a .png name"]);

    let bundle = BundleCopy::new("preview-none");
    edit_manifest(bundle.path(), |m| {
        m.as_object_mut().unwrap().remove("preview");
    });
    let never = dir.join("never.png");
    let run = klein([
        "generate",
        "an owl",
        "--model",
        bundle.arg(),
        "-o",
        path_str(&never),
        "--preview",
        path_str(&dir.join("q.png")),
    ]);
    assert_eq!(run.code, Some(2), "{}", run.describe());
    assert_mentions(
        &run.stderr,
        &["no step-preview map", "klein-export preview"],
    );
    assert!(!never.exists());
}
