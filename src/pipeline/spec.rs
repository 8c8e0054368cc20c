//! What a front end asks for ([`RequestSpec`]: numbers, a seed or none, images as files or bytes,
//! LoRAs, previews) and the one recipe that turns it into a ready [`Request`],
//! [`Pipeline::prepare`]. The CLI, its batch mode, the C API, the Python bindings and the server
//! fill a spec and call it; none checks a bound or reads an image itself.
//!
//! The recipe, in order: every number and rule ([`RequestSpec::check`]: no file is read), every
//! image's header (sizes and the token budget before any pixel is decoded), the
//! source and its mask, the references (at the source's size), and a seed below 2^53 when none
//! was given.
use std::borrow::Cow;
use std::fmt;
use std::path::{Path, PathBuf};

use super::inpaint::decode_mask;
use super::request::{
    check_mask_crop, check_reference_count, check_token_budget, no_flux3_inpaint,
};
use super::{random_seed, Inpaint, LoraSpec, Pipeline, Request};
use crate::error::{KleinError, Result};
use crate::stages::inpaint::{check_strength, DEFAULT_STRENGTH};
use crate::stages::mask::{preprocess_mask, Mask};
use crate::stages::reference::{
    decode_image_bytes, fill_plan, processed_size, read_file, read_header_bytes, source_size,
    ReferenceImage,
};

/// An image a request names: a file (read once, so a pipe works), or a file's bytes held in
/// memory with the label that names it in errors.
#[derive(Clone, PartialEq, Eq)]
pub enum ImageInput {
    File(PathBuf),
    Encoded { bytes: Vec<u8>, label: PathBuf },
}

impl ImageInput {
    pub fn file(path: impl Into<PathBuf>) -> Self {
        ImageInput::File(path.into())
    }

    pub fn encoded(bytes: impl Into<Vec<u8>>, label: impl Into<PathBuf>) -> Self {
        ImageInput::Encoded {
            bytes: bytes.into(),
            label: label.into(),
        }
    }

    /// What names the image in errors and in the image's text: the path, or the label.
    pub fn label(&self) -> &Path {
        match self {
            ImageInput::File(path) => path,
            ImageInput::Encoded { label, .. } => label,
        }
    }

    /// The file's bytes (read now), or the bytes given.
    pub fn read(&self) -> Result<Cow<'_, [u8]>> {
        match self {
            ImageInput::File(path) => Ok(Cow::Owned(read_file(path)?)),
            ImageInput::Encoded { bytes, .. } => Ok(Cow::Borrowed(bytes)),
        }
    }

    /// A file that can be read only once (a pipe, a shell's `<(...)`): [`RequestSpec::check`]
    /// leaves its header to [`Pipeline::prepare`].
    fn read_once(&self) -> bool {
        match self {
            ImageInput::File(path) => {
                std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir())
            }
            ImageInput::Encoded { .. } => false,
        }
    }
}

impl fmt::Debug for ImageInput {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageInput::File(path) => f.debug_tuple("File").field(path).finish(),
            ImageInput::Encoded { bytes, label } => f
                .debug_struct("Encoded")
                .field("bytes", &bytes.len())
                .field("label", label)
                .finish(),
        }
    }
}

/// How a mask image marks what to repaint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MaskKind {
    /// White repaints, black keeps (diffusers' `mask_image`).
    #[default]
    White,
    /// Fully transparent pixels repaint (OpenAI's edits).
    Transparent,
}

/// Everything a front end can ask of one generation, before anything is read. Fill the fields
/// (`RequestSpec::new(prompt)` gives one image, the bundle's defaults, a random seed) and call
/// [`Pipeline::prepare`].
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct RequestSpec {
    pub prompt: String,
    /// Output size; default: the source's, else the first reference's, else the bundle's.
    pub width: Option<u32>,
    pub height: Option<u32>,
    /// Default: the manifest's.
    pub steps: Option<usize>,
    /// Default: the manifest's (base models only).
    pub guidance: Option<f64>,
    pub negative_prompt: Option<String>,
    /// `None`: a random seed below [`super::RANDOM_SEED_LIMIT`], returned in the request.
    pub seed: Option<u64>,
    /// Images per prompt: 1 to [`crate::limits::MAX_BATCH`].
    pub num_images: usize,
    pub references: Vec<ImageInput>,
    /// Inpainting or img2img: the image to edit; the output has its size.
    pub source: Option<ImageInput>,
    /// Where to repaint (needs `source`); `None`: img2img, everything is repainted.
    pub mask: Option<ImageInput>,
    pub mask_kind: MaskKind,
    /// In (0, 1] (needs `source`); default [`DEFAULT_STRENGTH`].
    pub strength: Option<f64>,
    /// diffusers' `padding_mask_crop` (needs `mask`): inpaint the mask's region only, with this
    /// many pixels of context (0 to [`crate::limits::MAX_SIDE`]).
    pub mask_crop: Option<u32>,
    /// The LoRAs to apply (in place of the pipeline's, by [`Pipeline::generate`]); `None`: keep
    /// the pipeline's.
    pub loras: Option<Vec<LoraSpec>>,
    /// A step preview every this many steps.
    pub preview_every: Option<usize>,
}

/// Which input of a [`RequestSpec`] an error is about, for a front end to name it its own way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    Source,
    Mask,
    /// The index in [`RequestSpec::references`].
    Reference(usize),
}

/// A rule between a spec's fields that a front end words in its own names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// A mask, a strength or a mask crop without a source image.
    NeedsSource,
    /// A mask crop without a mask.
    MaskCropNeedsMask,
}

/// An error of [`Pipeline::prepare`] or [`RequestSpec::check`]: the library's error, and which
/// input or rule it is about. Prints as the error.
#[derive(Debug)]
#[non_exhaustive]
pub struct SpecError {
    pub error: KleinError,
    pub input: Option<Input>,
    pub rule: Option<Rule>,
}

impl SpecError {
    fn of(input: Input) -> impl Fn(KleinError) -> SpecError {
        move |error| SpecError {
            error,
            input: Some(input),
            rule: None,
        }
    }

    fn rule(rule: Rule) -> SpecError {
        let error = match rule {
            Rule::NeedsSource => KleinError::request_about(
                "image",
                "a mask, a strength or a mask crop needs a source image",
            ),
            Rule::MaskCropNeedsMask => KleinError::request_about(
                "padding_mask_crop",
                "padding_mask_crop needs a mask: it crops to the mask's region",
            ),
        };
        SpecError {
            error,
            input: None,
            rule: Some(rule),
        }
    }
}

impl From<KleinError> for SpecError {
    fn from(error: KleinError) -> Self {
        SpecError {
            error,
            input: None,
            rule: None,
        }
    }
}

impl From<SpecError> for KleinError {
    fn from(error: SpecError) -> Self {
        error.error
    }
}

impl fmt::Display for SpecError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for SpecError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&self.error)
    }
}

impl RequestSpec {
    pub fn new(prompt: impl Into<String>) -> Self {
        RequestSpec {
            prompt: prompt.into(),
            num_images: 1,
            ..Default::default()
        }
    }

    /// The request's numbers, without images or a seed.
    fn numbers(&self) -> Request {
        let mut request = Request::new(self.prompt.clone()).with_num_images(self.num_images);
        request.width = self.width;
        request.height = self.height;
        request.steps = self.steps;
        request.guidance = self.guidance;
        request.negative_prompt = self.negative_prompt.clone();
        request.preview_every = self.preview_every;
        request
    }

    /// What can be checked with no bundle: every number ([`Request::check_bounds`]), the number
    /// of images, the strength and the mask crop's padding, the rules between the inpainting
    /// fields, and that every image file has a header klein reads (pipes excepted: they are read
    /// once, by [`Pipeline::prepare`]). Cheap: a front end calls it before loading a bundle;
    /// [`Pipeline::prepare`] calls it too.
    pub fn check(&self) -> Result<(), SpecError> {
        self.check_numbers()?;
        let inputs = self.images();
        for (input, image) in inputs {
            if !image.read_once() {
                read_header_bytes(&image.read().map_err(SpecError::of(input))?, image.label())
                    .map_err(SpecError::of(input))?;
            }
        }
        Ok(())
    }

    fn check_numbers(&self) -> Result<(), SpecError> {
        self.numbers().check_bounds()?;
        check_reference_count(self.references.len() + usize::from(self.source.is_some()))
            .map_err(|e| e.about("references"))?;
        if self.source.is_none()
            && (self.mask.is_some() || self.strength.is_some() || self.mask_crop.is_some())
        {
            return Err(SpecError::rule(Rule::NeedsSource));
        }
        if let Some(strength) = self.strength {
            check_strength(strength)?;
        }
        if let Some(padding) = self.mask_crop {
            check_mask_crop(padding)?;
        }
        if self.mask_crop.is_some() && self.mask.is_none() {
            return Err(SpecError::rule(Rule::MaskCropNeedsMask));
        }
        Ok(())
    }

    /// Every image with the input it is: the source, the mask, the references.
    fn images(&self) -> Vec<(Input, &ImageInput)> {
        let inpaint = [(Input::Source, &self.source), (Input::Mask, &self.mask)];
        inpaint
            .into_iter()
            .filter_map(|(input, image)| image.as_ref().map(|i| (input, i)))
            .chain(
                self.references
                    .iter()
                    .enumerate()
                    .map(|(i, r)| (Input::Reference(i), r)),
            )
            .collect()
    }
}

/// The bytes of an optional image, an error about `input`.
fn read_input(
    input: Input,
    image: Option<&ImageInput>,
) -> Result<Option<Cow<'_, [u8]>>, SpecError> {
    image
        .map(|image| image.read().map_err(SpecError::of(input)))
        .transpose()
}

impl Pipeline {
    /// The one recipe from a [`RequestSpec`] to a [`Request`] ready for [`Pipeline::generate`]:
    /// checks every number and rule ([`RequestSpec::check`]), reads
    /// each image once and checks them all from their headers (each a size the pipeline takes,
    /// the output and the images within the token budget) before any is decoded, then loads the
    /// source and its mask (inpainting; default strength [`DEFAULT_STRENGTH`]) and the references
    /// at the source's size, and draws a seed below 2^53 when none is given. The error says
    /// which input or rule it is about.
    pub fn prepare(&self, spec: &RequestSpec) -> Result<Request, SpecError> {
        spec.check_numbers()?;
        if self.is_flux3() && spec.source.is_some() {
            return Err(SpecError::of(Input::Source)(no_flux3_inpaint(
                &self.manifest,
            )));
        }
        let source_bytes = read_input(Input::Source, spec.source.as_ref())?;
        let mask_bytes = read_input(Input::Mask, spec.mask.as_ref())?;
        let reference_bytes = spec
            .references
            .iter()
            .enumerate()
            .map(|(i, r)| r.read().map_err(SpecError::of(Input::Reference(i))))
            .collect::<Result<Vec<_>, _>>()?;
        // Headers, sizes and the token budget, before any pixel is decoded.
        let limits = &self.manifest.references.limits;
        let m = self.manifest.latents.pixel_multiple;
        let source_size = match (&spec.source, &source_bytes) {
            (Some(image), Some(bytes)) => {
                let at = SpecError::of(Input::Source);
                let header = read_header_bytes(bytes, image.label()).map_err(&at)?;
                let size = source_size(
                    header.width,
                    header.height,
                    limits.max_area,
                    m,
                    image.label(),
                );
                Some(size.map_err(at)?)
            }
            _ => None,
        };
        if let (Some(image), Some(bytes)) = (&spec.mask, &mask_bytes) {
            read_header_bytes(bytes, image.label()).map_err(SpecError::of(Input::Mask))?;
        }
        // FLUX.3 keeps a single reference whole, on a padded canvas (fill_reference).
        let single = self.is_flux3() && spec.references.len() == 1;
        let mut sizes = Vec::with_capacity(spec.references.len());
        for (i, (image, bytes)) in spec.references.iter().zip(&reference_bytes).enumerate() {
            let at = SpecError::of(Input::Reference(i));
            let header = read_header_bytes(bytes, image.label()).map_err(&at)?;
            sizes.push(match single {
                true => fill_plan(header.width, header.height, m).canvas,
                false => processed_size(header.width, header.height, limits, m, image.label())
                    .map_err(at)?,
            });
        }
        let first = source_size.or(sizes.first().copied());
        let width = spec.width.or(first.map(|s| s.0));
        let height = spec.height.or(first.map(|s| s.1));
        let width = width.unwrap_or(self.manifest.model.default_width);
        let height = height.unwrap_or(self.manifest.model.default_height);
        let tokens: usize = source_size
            .iter()
            .chain(&sizes)
            .map(|&(w, h)| (w / m * (h / m)) as usize)
            .sum();
        let count = sizes.len() + usize::from(source_size.is_some());
        check_token_budget(
            self.manifest.model.family.max_image_tokens(),
            (width / m * (height / m)) as usize,
            tokens,
            count,
        )?;

        let mut request = spec
            .numbers()
            .with_seed(spec.seed.unwrap_or_else(random_seed));
        request.loras = spec.loras.clone();
        if let (Some(source), Some(bytes)) = (&spec.source, &source_bytes) {
            let strength = spec.strength.unwrap_or(DEFAULT_STRENGTH);
            let mask = match (&spec.mask, &mask_bytes) {
                (Some(image), Some(bytes)) => Some((image.label(), bytes.as_ref())),
                _ => None,
            };
            request.inpaint = Some(self.load_inpaint(
                (source.label(), bytes),
                mask,
                spec.mask_kind,
                strength,
                spec.mask_crop,
            )?);
        }
        request.references = spec
            .references
            .iter()
            .zip(&reference_bytes)
            .enumerate()
            .map(|(i, (image, bytes))| {
                let decoded = match single {
                    true => self.decode_single_reference(bytes, image.label()),
                    false => self.decode_reference(bytes, image.label()),
                };
                decoded.map_err(SpecError::of(Input::Reference(i)))
            })
            .collect::<Result<_, _>>()?;
        Ok(request)
    }

    /// The source and its mask, decoded and preprocessed (cropped to the mask's region with a
    /// mask crop).
    fn load_inpaint(
        &self,
        (source_label, source): (&Path, &[u8]),
        mask: Option<(&Path, &[u8])>,
        kind: MaskKind,
        strength: f64,
        mask_crop: Option<u32>,
    ) -> Result<Inpaint, SpecError> {
        let decode_mask = |(label, bytes): (&Path, &[u8])| {
            decode_mask(bytes, label, kind).map_err(SpecError::of(Input::Mask))
        };
        let source_rgb =
            decode_image_bytes(source, source_label).map_err(SpecError::of(Input::Source))?;
        if let (Some(padding), Some(mask)) = (mask_crop, mask) {
            let mask_rgb = decode_mask(mask)?;
            // Its errors are the mask's (its region, its size against the source's) but for the
            // source's size, which names the source.
            return self
                .crop_to_mask(
                    source_rgb,
                    mask_rgb,
                    padding,
                    strength,
                    (source_label, mask.0),
                )
                .map_err(|error| {
                    let input = match &error {
                        KleinError::Image { path, .. }
                            if source_label != mask.0 && path == source_label =>
                        {
                            Input::Source
                        }
                        _ => Input::Mask,
                    };
                    SpecError::of(input)(error)
                });
        }
        let source_image = self
            .source_from(&source_rgb, source_label)
            .map_err(SpecError::of(Input::Source))?;
        let mask = mask
            .map(|mask| Ok::<Mask, SpecError>(self.mask_for(&decode_mask(mask)?, &source_image)))
            .transpose()?;
        Ok(Inpaint::new(source_image, mask, strength))
    }

    /// A mask decoded to RGB (white repaints), at `source`'s size.
    pub(crate) fn mask_for(&self, rgb: &image::RgbImage, source: &ReferenceImage) -> Mask {
        preprocess_mask(rgb, source.width, source.height)
    }
}
