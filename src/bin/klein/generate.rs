//! `klein generate PROMPT`: one request from the command line's flags, its input images checked
//! and read, its outputs written; batch mode ([`crate::batch`]) reuses the checks and readers.
use std::path::{Path, PathBuf};

use klein::fsutil::write_all_atomic;
use klein::pipeline::{ImageInput, Input, Pipeline, RequestSpec, Rule, SpecError};
use klein::stages::output::{encode_image, ImageFormat};

use crate::args::{default_model, pipeline_options, GenerateArgs};
use crate::outputs::output_files;
use crate::report::Reporter;
use crate::UsageError;

/// A [`SpecError`] as the command line words it: the rules between the inpainting flags in the
/// flags' names (and a batch line's fields), and, `flagged` (the command line's own images, checked
/// before the bundle loads), the flag of the image an error is about.
pub(crate) fn spec_error(error: SpecError, flagged: bool) -> anyhow::Error {
    let usage = |message: &str| UsageError(message.to_string()).into();
    match (error.rule, error.input) {
        (Some(Rule::NeedsSource), _) => usage(
            "a mask, a strength or a mask crop needs a source image (--image; in a --prompts \
             line, \"image\")",
        ),
        (Some(_), _) => {
            usage("--mask-crop needs a mask (--mask): it crops the source to the mask's region")
        }
        (None, Some(input)) if flagged => {
            let flag = match input {
                Input::Source => "--image",
                Input::Mask => "--mask",
                Input::Reference(_) => "--ref",
            };
            anyhow::Error::new(error.error).context(flag)
        }
        _ => error.error.into(),
    }
}

/// The `--preview` files for `n` images (as `-o` names outputs), PNG only; none without it.
/// Refused where one would overwrite an output (`outputs`) or an input image.
pub(crate) fn preview_files(
    args: &GenerateArgs,
    n: usize,
    outputs: &[PathBuf],
) -> anyhow::Result<Vec<PathBuf>> {
    let Some(path) = &args.preview else {
        return Ok(Vec::new());
    };
    let (paths, format) = output_files("--preview", path, n, None)?;
    if format != ImageFormat::Png {
        return Err(UsageError(format!(
            "--preview {}: previews are PNG files; give a .png name",
            path.display()
        ))
        .into());
    }
    let others = (outputs.iter().map(|p| ("an output (-o)", p)))
        .chain(args.image.iter().map(|p| ("the source image (--image)", p)))
        .chain(inputs_kept(args));
    if let Some((preview, what)) = first_overlap(&paths, others) {
        return Err(UsageError(format!(
            "--preview {} is also {what}: the previews would overwrite it; give them another file name",
            preview.display()
        ))
        .into());
    }
    Ok(paths)
}

/// Whether `a` and `b` name one file: each resolved ([`resolved`]), else compared as absolute paths.
pub(crate) fn same_file(a: &Path, b: &Path) -> bool {
    match (resolved(a), resolved(b)) {
        (Some(a), Some(b)) => a == b,
        _ => matches!((std::path::absolute(a), std::path::absolute(b)), (Ok(a), Ok(b)) if a == b),
    }
}

/// `path` with links, `.` and `..` resolved: the file's own where it exists, else (a file not
/// written yet, or a dangling link, followed as a write follows it) its directory's and its name
/// (`out/../out/a.png` names `out/a.png` before it is written).
pub(crate) fn resolved(path: &Path) -> Option<PathBuf> {
    if let Ok(path) = path.canonicalize() {
        return Some(path);
    }
    let path = klein::fsutil::replaced_file(path);
    let name = path.file_name()?;
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty());
    Some(
        dir.unwrap_or(Path::new("."))
            .canonicalize()
            .ok()?
            .join(name),
    )
}

/// The inputs no file klein writes may replace: the mask and the references (the source image
/// may be edited in place), each with what it is.
pub(crate) fn inputs_kept(args: &GenerateArgs) -> impl Iterator<Item = (&'static str, &PathBuf)> {
    (args.mask.iter().map(|p| ("the mask (--mask)", p)))
        .chain(args.refs.iter().map(|p| ("a reference (--ref)", p)))
}

/// The first of `paths` that is one of `others` ([`same_file`]), and what that one is.
pub(crate) fn first_overlap<'a>(
    paths: &'a [PathBuf],
    others: impl Iterator<Item = (&'static str, &'a PathBuf)>,
) -> Option<(&'a PathBuf, &'static str)> {
    others.into_iter().find_map(|(what, other)| {
        paths
            .iter()
            .find(|p| same_file(p, other))
            .map(|p| (p, what))
    })
}

/// Refuses outputs that are the mask or a reference: a mistyped `-o` would otherwise replace an
/// input the user keeps.
pub(crate) fn check_outputs_spare_inputs(
    args: &GenerateArgs,
    outputs: &[PathBuf],
) -> anyhow::Result<()> {
    match first_overlap(outputs, inputs_kept(args)) {
        Some((output, what)) => Err(UsageError(format!(
            "output {} is also {what}: writing it would replace that input; give the output another file name",
            output.display()
        ))
        .into()),
        None => Ok(()),
    }
}

/// The files an inpainting request read, for the image's text.
pub(crate) fn inpaint_metadata(image: Option<&Path>, mask: Option<&Path>) -> Vec<(String, String)> {
    [("image", image), ("mask_image", mask)]
        .into_iter()
        .filter_map(|(key, path)| path.map(|p| (key.to_string(), p.display().to_string())))
        .collect()
}

/// The spec of `prompt` with the command line's size, steps, guidance, negative prompt and
/// preview interval: one prompt's, or the defaults of a batch's lines.
pub(crate) fn command_line_spec(args: &GenerateArgs, prompt: &str) -> RequestSpec {
    let mut spec = RequestSpec::new(prompt);
    spec.width = args.width;
    spec.height = args.height;
    spec.steps = args.steps;
    spec.guidance = args.guidance;
    spec.negative_prompt = args.negative_prompt.clone();
    spec.preview_every = args
        .preview
        .is_some()
        .then_some(usize::from(args.preview_every));
    spec
}

/// The command line's source image, mask, strength and mask crop in `spec`.
pub(crate) fn with_inpaint_flags(mut spec: RequestSpec, args: &GenerateArgs) -> RequestSpec {
    spec.source = args.image.clone().map(ImageInput::File);
    spec.mask = args.mask.clone().map(ImageInput::File);
    spec.strength = args.strength;
    spec.mask_crop = args.mask_crop;
    spec
}

/// `klein generate PROMPT -o FILE`: one prompt, `--num-images` images.
pub(crate) fn generate_one(args: &GenerateArgs, prompt: &str) -> anyhow::Result<()> {
    let model = default_model(args.load.model.clone())?;
    let (paths, format) = output_files(
        "output",
        &args.output,
        usize::from(args.num_images),
        args.quality,
    )?;
    check_outputs_spare_inputs(args, &paths)?;
    let previews = preview_files(args, usize::from(args.num_images), &paths)?;
    let reporter = Reporter::new(args.quiet).with_previews(previews);

    let mut spec = with_inpaint_flags(command_line_spec(args, prompt), args);
    spec.seed = args.seed;
    spec.num_images = usize::from(args.num_images);
    spec.references = args.refs.iter().cloned().map(ImageInput::File).collect();
    // Every number the user gave and every image's header, before the bundle loads.
    spec.check().map_err(|e| spec_error(e, true))?;

    // Every error of `Pipeline::load` names the bundle or the file in it.
    let mut pipeline = Pipeline::load(
        &model,
        // One image per process: the decoder reuses the transformer's memory (benches/RESULTS.md, "Memory
        // at large sizes").
        pipeline_options(&args.load, args.device, args.loras.clone())
            .with_release_transformer(true),
    )?;
    let request = pipeline.prepare(&spec).map_err(|e| spec_error(e, false))?;
    let seed = request.seed;
    let (width, height) = pipeline.output_size(&request)?;
    reporter.say(format!("seed: {seed}"));
    reporter.say(format!(
        "model: {} ({}), {width}x{height}",
        pipeline.manifest().model.name,
        model.display()
    ));

    let generation = pipeline.generate(&request, Some(&mut reporter.callback("")))?;
    reporter.clear();
    let device = pipeline.device_name();
    reporter.report(&mut pipeline, &generation, args.timings, "");
    reporter.say(format!("device: {device}"));
    let refs: Vec<String> = args.refs.iter().map(|r| r.display().to_string()).collect();
    let mut text = pipeline.image_metadata(&generation, prompt, &refs, &pipeline.bundle_sha256()?);
    text.extend(inpaint_metadata(
        args.image.as_deref(),
        args.mask.as_deref(),
    ));
    // Every image of the command, or none: a failure leaves earlier outputs as they were.
    let encoded = generation
        .images
        .iter()
        .map(|image| encode_image(image, format, &text))
        .collect::<klein::Result<Vec<_>>>()?;
    let files: Vec<(&Path, &[u8])> = paths
        .iter()
        .map(PathBuf::as_path)
        .zip(encoded.iter().map(Vec::as_slice))
        .collect();
    write_all_atomic(&files)?;
    for path in &paths {
        println!("{}", path.display());
    }
    Ok(())
}
