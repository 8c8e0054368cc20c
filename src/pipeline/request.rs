//! What to generate ([`Request`]) and its validation, in one place, before anything is loaded:
//! `Plan::new` checks every number of a request against the bundle and [`crate::limits`].
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

use ndarray::Array4;

use super::prompts::PromptEmbeds;
use crate::bundle::{Manifest, ModelFamily};
use crate::error::{KleinError, Result};
use crate::limits::{
    MAX_BATCH, MAX_CPU_CACHE_GIB, MAX_GUIDANCE, MAX_IMAGE_TOKENS, MAX_PROMPT_BYTES, MAX_REFERENCES,
    MAX_SIDE, MAX_STEPS, MAX_THREADS, MIN_SIDE,
};
use crate::runtime::SessionConfig;
use crate::stages::inpaint::first_step;
use crate::stages::mask::Mask;
use crate::stages::mask_crop::{paste_back, CropRegion};
use crate::stages::output::RgbImage;
use crate::stages::reference::ReferenceImage;

/// Random seeds ([`random_seed`]) are below this, 2^53: JSON clients whose numbers are doubles
/// (JavaScript) send them back exactly.
pub const RANDOM_SEED_LIMIT: u64 = 1 << 53;

/// A seed for a generation that names none, as every front end draws it (the CLI, batch mode, the
/// server, Python and Ray Serve): printed or returned and stored in the image, so the image can be
/// made again. Below [`RANDOM_SEED_LIMIT`].
pub fn random_seed() -> u64 {
    // RandomState's keys are random per process and differ for each value made in a thread.
    RandomState::new().hash_one(std::process::id()) % RANDOM_SEED_LIMIT
}

/// Inpainting and img2img, as diffusers' `Flux2KleinInpaintPipeline`: the output starts from the
/// source image's latents noised to `strength`, the source is the transformer's first reference,
/// and after every step the tokens the mask keeps are put back on the source's noising path.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Inpaint {
    /// The source image ([`super::Pipeline::load_source`]); the output has its size.
    pub image: ReferenceImage,
    /// Where to repaint ([`super::Pipeline::load_mask`], at the source's size); `None`: img2img,
    /// everything is repainted (a white mask).
    pub mask: Option<Mask>,
    /// In (0, 1]: the share of the schedule that runs
    /// ([`crate::stages::inpaint::DEFAULT_STRENGTH`] says why 1.0 is klein's default).
    pub strength: f64,
    /// `padding_mask_crop` ([`super::Pipeline::crop_to_mask`]): `image` and `mask` are then the
    /// mask's region, and the output is pasted back into the whole source.
    pub crop: Option<MaskCrop>,
}

impl Inpaint {
    pub fn new(image: ReferenceImage, mask: Option<Mask>, strength: f64) -> Self {
        Inpaint {
            image,
            mask,
            strength,
            crop: None,
        }
    }
}

/// diffusers' `padding_mask_crop`: the region of the source that was inpainted
/// ([`crate::stages::mask_crop`]), and the source and mask as given, to paste the result back.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct MaskCrop {
    pub region: CropRegion,
    /// Pixels of context added around the mask's box before it is widened to the output's
    /// aspect ratio.
    pub padding: u32,
    source: image::RgbImage,
    mask: image::RgbImage,
}

impl MaskCrop {
    pub(crate) fn new(
        region: CropRegion,
        padding: u32,
        source: image::RgbImage,
        mask: image::RgbImage,
    ) -> Self {
        MaskCrop {
            region,
            padding,
            source,
            mask,
        }
    }

    /// The whole source with `generated` (the region's image) laid in through the mask
    /// ([`paste_back`]).
    pub fn paste_back(&self, generated: &RgbImage) -> RgbImage {
        let generated =
            image::RgbImage::from_raw(generated.width, generated.height, generated.pixels.clone())
                .unwrap_or_else(|| unreachable!("an RgbImage holds width * height * 3 bytes"));
        let whole = paste_back(&self.source, &self.mask, &generated, self.region);
        RgbImage {
            width: whole.width(),
            height: whole.height(),
            pixels: whole.into_raw(),
        }
    }

    /// The size of the output: the source's.
    pub fn size(&self) -> (u32, u32) {
        self.source.dimensions()
    }
}

/// What to generate.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Request {
    pub prompt: String,
    /// Preprocessed reference images ([`super::Pipeline::load_reference`],
    /// [`super::Pipeline::prepare_reference`]).
    pub references: Vec<ReferenceImage>,
    /// Output size; default: the first reference's size, else the bundle's default.
    pub width: Option<u32>,
    pub height: Option<u32>,
    /// Denoising steps; default: the manifest's.
    pub steps: Option<usize>,
    /// Classifier-free guidance scale (base models only); default: the manifest's.
    pub guidance: Option<f64>,
    /// What guidance steers away from (base models with guidance above 1 only); default: the
    /// empty prompt, as diffusers' `Flux2KleinPipeline` (whose `negative_prompt_embeds` this is).
    pub negative_prompt: Option<String>,
    pub seed: u64,
    /// Images per prompt (one batch); at least 1.
    pub num_images: usize,
    /// Initial latents `[num_images, 128, h, w]` instead of the seed's noise.
    pub initial_latents: Option<Array4<f32>>,
    /// Embeddings of `prompt` from [`super::Pipeline::encode_prompt`], reused instead of running
    /// the text encoder again (one prompt, many seeds). `[1, max_sequence_length, embed_dim]`.
    pub prompt_embeds: Option<PromptEmbeds>,
    /// Inpainting or img2img from a source image ([`Inpaint`]); `references` are then its
    /// `image_reference`s, after the source.
    pub inpaint: Option<Inpaint>,
    /// A [`super::Progress::Preview`] every this many steps, and after the last (the bundle's
    /// manifest must have a `preview` map).
    pub preview_every: Option<usize>,
    /// LoRAs that [`super::Pipeline::generate`] applies first ([`super::Pipeline::set_loras`]);
    /// `None`: the pipeline's.
    pub loras: Option<Vec<super::LoraSpec>>,
}

impl Request {
    pub fn new(prompt: impl Into<String>) -> Self {
        Request {
            prompt: prompt.into(),
            num_images: 1,
            ..Default::default()
        }
    }
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    pub fn with_size(mut self, width: u32, height: u32) -> Self {
        self.width = Some(width);
        self.height = Some(height);
        self
    }
    pub fn with_steps(mut self, steps: usize) -> Self {
        self.steps = Some(steps);
        self
    }
    pub fn with_guidance(mut self, guidance: f64) -> Self {
        self.guidance = Some(guidance);
        self
    }
    pub fn with_negative_prompt(mut self, negative: impl Into<String>) -> Self {
        self.negative_prompt = Some(negative.into());
        self
    }
    pub fn with_reference(mut self, reference: ReferenceImage) -> Self {
        self.references.push(reference);
        self
    }
    pub fn with_num_images(mut self, n: usize) -> Self {
        self.num_images = n;
        self
    }
    pub fn with_initial_latents(mut self, latents: Array4<f32>) -> Self {
        self.initial_latents = Some(latents);
        self
    }
    pub fn with_prompt_embeds(mut self, embeds: PromptEmbeds) -> Self {
        self.prompt_embeds = Some(embeds);
        self
    }
    pub fn with_inpaint(mut self, inpaint: Inpaint) -> Self {
        self.inpaint = Some(inpaint);
        self
    }
    pub fn with_previews(mut self, every: usize) -> Self {
        self.preview_every = Some(every);
        self
    }

    /// Every image the VAE encodes for the transformer, in order: the source (inpainting and
    /// img2img), then the references.
    pub(crate) fn conditioning_images(&self) -> impl Iterator<Item = &ReferenceImage> {
        self.inpaint
            .as_ref()
            .map(|i| &i.image)
            .into_iter()
            .chain(&self.references)
    }
}

impl Request {
    /// Checks the numbers given in this request against [`crate::limits`], without a bundle:
    /// images per prompt, steps, guidance, preview interval, prompt length, reference count and
    /// output sides. Cheap: call it before loading anything ([`super::Pipeline::generate`] calls
    /// it too). The error names the field of the first number out of bounds
    /// ([`KleinError::param`]): `num_images`, `steps`, `guidance`, `preview_every`, `prompt`,
    /// `negative_prompt`, `references` (their count), `width` or `height` (`width` also when the
    /// two sides together exceed the token budget), so that an API can report it as its own
    /// argument.
    pub fn check_bounds(&self) -> Result<()> {
        let at = |field: &'static str| move |error: KleinError| error.about(field);
        if self.num_images == 0 || self.num_images > MAX_BATCH {
            return Err(KleinError::request_about(
                "num_images",
                format!(
                    "num_images is {}: it must be between 1 and {MAX_BATCH}",
                    self.num_images
                ),
            ));
        }
        if let Some(steps) = self.steps {
            check_steps(steps).map_err(at("steps"))?;
        }
        if let Some(guidance) = self.guidance {
            check_guidance(guidance).map_err(at("guidance"))?;
        }
        match self.preview_every {
            Some(0) => {
                return Err(KleinError::request_about(
                    "preview_every",
                    "preview_every must be at least 1 step",
                ))
            }
            Some(n) if n > MAX_STEPS => {
                return Err(KleinError::request_about(
                    "preview_every",
                    format!("preview_every is {n}: give 1 to {MAX_STEPS} steps"),
                ))
            }
            _ => {}
        }
        check_prompt(&self.prompt).map_err(at("prompt"))?;
        if let Some(negative) = &self.negative_prompt {
            check_prompt(negative).map_err(at("negative_prompt"))?;
        }
        check_reference_count(self.conditioning_images().count()).map_err(at("references"))?;
        for (what, value) in [("width", self.width), ("height", self.height)] {
            if let Some(value) = value.filter(|v| !(MIN_SIDE..=MAX_SIDE).contains(v)) {
                return Err(KleinError::request_about(what, format!(
                    "{what} {value} is out of range: it must be between {MIN_SIDE} and {MAX_SIDE} pixels \
                     (and width/16 x height/16 plus the references' tokens at most {MAX_IMAGE_TOKENS})"
                )));
            }
        }
        // The output's own tokens (one per MIN_SIDE x MIN_SIDE pixels); the references' are
        // added once their sizes are read.
        if let (Some(width), Some(height)) = (self.width, self.height) {
            let tokens = (width / MIN_SIDE) as usize * (height / MIN_SIDE) as usize;
            check_token_budget(MAX_IMAGE_TOKENS, tokens, 0, 0)?; // about `width` already
        }
        Ok(())
    }
}

/// Between 1 and [`MAX_STEPS`] denoising steps.
fn check_steps(steps: usize) -> Result<()> {
    if steps == 0 || steps > MAX_STEPS {
        return Err(KleinError::request(format!(
            "steps is {steps}: it must be between 1 and {MAX_STEPS}"
        )));
    }
    Ok(())
}

/// A guidance scale between 0 and [`MAX_GUIDANCE`].
fn check_guidance(guidance: f64) -> Result<()> {
    if !(0.0..=MAX_GUIDANCE).contains(&guidance) {
        return Err(KleinError::request(format!(
            "guidance {guidance} must be a number between 0 and {MAX_GUIDANCE}"
        )));
    }
    Ok(())
}

/// A request checked against the bundle, with every default resolved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Plan {
    pub batch: usize,
    pub steps: usize,
    pub guidance: f64,
    /// Classifier-free guidance: a base model with guidance above 1 (as diffusers).
    pub cfg: bool,
    pub width: u32,
    pub height: u32,
    /// The output's latent grid.
    pub lat_h: usize,
    pub lat_w: usize,
    /// Inpainting and img2img: the first of the schedule's steps that runs (`get_timesteps`).
    pub first_step: Option<usize>,
}

impl Plan {
    /// Checks `request` against the bundle (stage 1 of diffusers' `__call__`, `check_inputs`).
    pub fn new(manifest: &Manifest, request: &Request) -> Result<Plan> {
        request.check_bounds()?;
        let model = &manifest.model;
        let batch = request.num_images;
        let steps = request.steps.unwrap_or(model.default_steps as usize);
        check_steps(steps)?;
        let guidance = request.guidance.unwrap_or(model.default_guidance);
        check_guidance(guidance)?;
        let (width, height) = output_size(manifest, request)?;
        let m = manifest.latents.pixel_multiple;
        let (lat_h, lat_w) = ((height / m) as usize, (width / m) as usize);
        if request.preview_every.is_some() && manifest.preview.is_none() {
            return Err(no_preview_map(manifest));
        }
        let first_step = match &request.inpaint {
            Some(_) if model.kv_cache => {
                return Err(KleinError::request(format!(
                    "{} is a KV bundle (Flux2KleinKVPipeline), which has no inpainting or img2img \
                     (diffusers has no KV inpaint pipeline): use a bundle of a plain checkpoint",
                    model.name
                )))
            }
            Some(_) if model.family == ModelFamily::Flux3 => {
                return Err(no_flux3_inpaint(manifest))
            }
            Some(inpaint) => Some(check_inpaint(inpaint, request, steps)?),
            None => None,
        };
        let ref_tokens: usize = request
            .conditioning_images()
            .map(|r| (r.width / m * (r.height / m)) as usize)
            .sum();
        check_token_budget(
            model.family.max_image_tokens(),
            lat_h * lat_w,
            ref_tokens,
            request.conditioning_images().count(),
        )?;
        if let Some(shapes) = &manifest.static_shapes {
            let sizes: Vec<(u32, u32)> = request
                .conditioning_images()
                .map(|r| (r.width, r.height))
                .collect();
            shapes
                .bucket_for_request(width, height, &sizes)
                .map_err(KleinError::request)?;
        }
        if let Some(latents) = &request.initial_latents {
            let want = (batch, manifest.latents.channels, lat_h, lat_w);
            if latents.dim() != want {
                return Err(KleinError::request(format!(
                    "initial latents have shape {:?}, expected {want:?}",
                    latents.dim()
                )));
            }
            check_finite("initial_latents", "initial latents", latents.iter())?;
        }
        if let Some(given) = &request.prompt_embeds {
            let (rows, length, width) = given.embeds.dim();
            let tokenizer = &manifest.tokenizer;
            if rows != 1 || !tokenizer.is_window(length) || width != manifest.text_encoder.embed_dim
            {
                return Err(KleinError::request(format!(
                    "prompt embeddings have shape {:?}, expected (1, {}, {}) (from Pipeline::encode_prompt of this bundle)",
                    given.embeds.dim(),
                    tokenizer.windows(),
                    manifest.text_encoder.embed_dim
                )));
            }
            check_finite("prompt_embeds", "prompt embeddings", given.embeds.iter())?;
        }
        // As diffusers: guidance applies to base (non-distilled) models only, when above 1.
        let cfg = !model.is_distilled && guidance > 1.0;
        // An empty one is the default (diffusers' ""), whatever the model.
        if request
            .negative_prompt
            .as_ref()
            .is_some_and(|n| !n.is_empty())
            && !cfg
        {
            return Err(KleinError::request_about(
                "negative_prompt",
                if model.is_distilled {
                    format!(
                    "a negative prompt needs classifier-free guidance, and {} is a distilled model \
                     (it runs without guidance); use a base model",
                    model.name
                )
                } else {
                    format!(
                    "a negative prompt needs guidance above 1 (it is {guidance}): guidance 1 or \
                     less runs without the negative branch, as in diffusers"
                )
                },
            ));
        }
        Ok(Plan {
            batch,
            steps,
            guidance,
            cfg,
            width,
            height,
            lat_h,
            lat_w,
            first_step,
        })
    }
}

/// Refuses given tensor values that are NaN or infinite: the denoising would carry them into
/// every pixel (an all-black image), with nothing to say where they came from.
fn check_finite<'a>(
    param: &'static str,
    what: &str,
    values: impl Iterator<Item = &'a f32>,
) -> Result<()> {
    let (mut bad, mut first) = (0usize, None);
    for (index, value) in values.enumerate() {
        if !value.is_finite() {
            bad += 1;
            first.get_or_insert((index, *value));
        }
    }
    match first {
        None => Ok(()),
        Some((index, value)) => Err(KleinError::request_about(
            param,
            format!(
                "{what} hold {bad} NaN or infinite value(s) (the first, {value}, at flat index \
                 {index}); every value must be finite"
            ),
        )),
    }
}

/// Inpainting's own checks; gives the first step that runs. The output is the source's size
/// ([`output_size`]: as diffusers, which takes `height` and `width` there and ignores them); the
/// mask must be at the source's size, and with several references all must have one size
/// (diffusers crops the others to the first's).
fn check_inpaint(inpaint: &Inpaint, request: &Request, steps: usize) -> Result<usize> {
    let source = &inpaint.image;
    if let Some(mask) = &inpaint.mask {
        if (mask.width, mask.height) != (source.width, source.height) {
            return Err(KleinError::request(format!(
                "the mask is {}x{} and the source image {}x{}: load the mask for this source \
                 (Pipeline::load_mask resizes it)",
                mask.width, mask.height, source.width, source.height
            )));
        }
    }
    if let Some(first) = request.references.first() {
        if let Some(other) = request
            .references
            .iter()
            .find(|r| (r.width, r.height) != (first.width, first.height))
        {
            return Err(KleinError::request(format!(
                "with a source image, every reference must have one size after preprocessing \
                 (diffusers' inpaint pipeline crops them all to the first's): {}x{} and {}x{}",
                first.width, first.height, other.width, other.height
            )));
        }
    }
    first_step(steps, inpaint.strength)
}

/// A prompt must be at most [`MAX_PROMPT_BYTES`] long.
pub(crate) fn check_prompt(prompt: &str) -> Result<()> {
    if prompt.len() > MAX_PROMPT_BYTES {
        return Err(KleinError::request(format!(
            "the prompt is {} bytes: at most {MAX_PROMPT_BYTES} are accepted (the text encoder reads \
             only the bundle's first tokenizer.max_sequence_length tokens of it)",
            prompt.len()
        )));
    }
    Ok(())
}

/// diffusers' `padding_mask_crop`: 0 to [`MAX_SIDE`] pixels of context around the mask.
pub fn check_mask_crop(padding: u32) -> Result<()> {
    if padding > MAX_SIDE {
        return Err(KleinError::request_about(
            "padding_mask_crop",
            format!("padding_mask_crop {padding}: give 0 to {MAX_SIDE} pixels"),
        ));
    }
    Ok(())
}

/// At most [`MAX_REFERENCES`] reference images per request.
pub fn check_reference_count(count: usize) -> Result<()> {
    if count > MAX_REFERENCES {
        return Err(KleinError::request(format!(
            "{count} reference images: at most {MAX_REFERENCES} per request"
        )));
    }
    Ok(())
}

/// The load options' numbers: at most [`MAX_THREADS`] threads, and at least 1 when given; the CPU
/// cache's size limit ([`check_cache_limit`]).
pub(crate) fn check_session(session: &SessionConfig) -> Result<()> {
    check_cache_limit(
        "cpu_cache_max_gib",
        session.cpu_cache_gib,
        MAX_CPU_CACHE_GIB,
        "GiB",
        session.cpu_cache_dir.is_some(),
        "--cpu-cache, cpu_cache, cpu_cache_dir",
    )?;
    if let Some(threads) = session.intra_threads {
        if threads == 0 || threads > MAX_THREADS {
            return Err(KleinError::request(format!(
                "threads is {threads}: it must be between 1 and {MAX_THREADS} (leave it unset for \
                 ONNX Runtime's choice, one per physical core)"
            )));
        }
    }
    Ok(())
}

/// Checks a cache's size limit `param` (in `unit`) where one is given: between 1 and `max`, and
/// with the cache directory (the option `dir`) to limit.
pub(crate) fn check_cache_limit(
    param: &'static str,
    limit: Option<u64>,
    max: u64,
    unit: &str,
    has_dir: bool,
    dir: &str,
) -> Result<()> {
    match limit {
        Some(value) if value == 0 || value > max => Err(KleinError::request_about(
            param,
            format!("{param} is {value}: it must be between 1 and {max} ({unit})"),
        )),
        Some(_) if !has_dir => Err(KleinError::request_about(
            param,
            format!("{param} needs the directory it limits ({dir})"),
        )),
        _ => Ok(()),
    }
}

/// Output size in pixels for a request: explicit, else the first reference's, else the bundle's
/// default; floored to the latent multiple (16), as the reference pipeline does.
pub fn output_size(manifest: &Manifest, request: &Request) -> Result<(u32, u32)> {
    let first = request.conditioning_images().next();
    // Inpainting and img2img make an image of the source's size, whatever width and height say, as
    // diffusers' inpaint pipeline does (it takes them and uses the source's); the pipeline warns.
    let (asked_width, asked_height) = match request.inpaint {
        Some(_) => (None, None),
        None => (request.width, request.height),
    };
    let width = asked_width
        .or(first.map(|r| r.width))
        .unwrap_or(manifest.model.default_width);
    let height = asked_height
        .or(first.map(|r| r.height))
        .unwrap_or(manifest.model.default_height);
    let multiple = manifest.latents.pixel_multiple;
    for (what, value, given) in [
        ("width", width, asked_width),
        ("height", height, asked_height),
    ] {
        if value < multiple || value > MAX_SIDE {
            // A size nobody gave is the image's: say so, and how to change it.
            let whence = match (given, first) {
                (None, Some(_)) => {
                    " (the source or first reference image's, as no size was given: resize the image)"
                }
                _ => "",
            };
            return Err(KleinError::request_about(what, format!(
                "{what} {value}{whence} is out of range: it must be between {multiple} and {MAX_SIDE} pixels"
            )));
        }
    }
    Ok((width / multiple * multiple, height / multiple * multiple))
}

/// Output plus reference tokens must fit in one transformer call: `max` tokens, the model
/// family's ([`crate::bundle::ModelFamily::max_image_tokens`]; [`MAX_IMAGE_TOKENS`] before the
/// bundle is known).
pub fn check_token_budget(
    max: usize,
    output_tokens: usize,
    reference_tokens: usize,
    references: usize,
) -> Result<()> {
    let total = output_tokens + reference_tokens;
    if total > max {
        // About `width`: the output's size is the one number that always takes part.
        return Err(KleinError::request_about("width", format!(
            "{total} image tokens ({output_tokens} for the output + {reference_tokens} for {references} reference(s)): \
             at most {max} fit; use fewer or smaller references or a smaller output"
        )));
    }
    Ok(())
}

/// The error of inpainting or img2img asked of a FLUX.3 bundle.
pub(crate) fn no_flux3_inpaint(manifest: &Manifest) -> KleinError {
    KleinError::request_about(
        "image",
        format!(
            "{} is a FLUX.3 Image Klein bundle, which has no inpainting or img2img (diffusers' FLUX.3 \
             pipelines have none): give the image as a reference (--ref) to edit it",
            manifest.model.name
        ),
    )
}

/// The error of a preview asked of a bundle without a preview map.
pub(crate) fn no_preview_map(manifest: &Manifest) -> KleinError {
    KleinError::request(format!(
        "bundle {} has no step-preview map (exported before previews existed): add one with \
         `klein-export preview --checkpoint CHECKPOINT --bundle BUNDLE`",
        manifest.model.name
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    #[test]
    fn random_seeds_are_below_2_53_and_differ() {
        let seeds: std::collections::BTreeSet<u64> = (0..1000).map(|_| random_seed()).collect();
        assert!(seeds.len() > 990);
        let largest = *seeds.last().unwrap();
        // 1,000 draws all below 2^52 would have odds of 2^-1000.
        assert!((RANDOM_SEED_LIMIT / 2..RANDOM_SEED_LIMIT).contains(&largest));
    }
}
