//! The arguments the Python side passes for LoRAs, references and inpainting, turned into the
//! library's values (files read, bytes decoded, masks loaded at the source's size).
use std::path::{Path, PathBuf};

use klein::pipeline::{Inpaint, LoraSpec, Pipeline};
use klein::stages::mask::{decode_transparent_mask, load_transparent_mask};
use klein::stages::reference::{decode_image, decode_image_bytes};
use klein::KleinError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::*;

/// A LoRA as Python gives it: `(path, scale)`, `"FILE"` or `"FILE:SCALE"`, or an `os.PathLike`.
#[derive(FromPyObject)]
pub(crate) enum LoraArg {
    Pair(PathBuf, f32),
    Text(String),
    Path(PathBuf),
}

impl LoraArg {
    pub(crate) fn spec(self) -> LoraSpec {
        match self {
            LoraArg::Pair(path, scale) => LoraSpec::new(path, scale),
            LoraArg::Text(text) => LoraSpec::parse(&text),
            LoraArg::Path(path) => LoraSpec::new(path, 1.0),
        }
    }
}

/// A reference image as the Python side passes it: a path (read by klein, labelled by the string
/// as given) or the bytes of an image file with its label. Paths and labels are the OS's: a file
/// name that is not UTF-8 (`os.fsdecode`'s surrogates) is read as it is.
#[derive(FromPyObject)]
pub(crate) enum ReferenceArg<'py> {
    Encoded(Bound<'py, PyBytes>, PathBuf),
    Path(PathBuf),
}

/// A [`ReferenceArg`] copied out of Python's objects, for use without the GIL.
pub(crate) enum Reference {
    Encoded(Vec<u8>, PathBuf),
    Path(PathBuf),
}

impl From<ReferenceArg<'_>> for Reference {
    fn from(arg: ReferenceArg<'_>) -> Self {
        match arg {
            ReferenceArg::Encoded(bytes, label) => {
                Reference::Encoded(bytes.as_bytes().to_vec(), label)
            }
            ReferenceArg::Path(path) => Reference::Path(path),
        }
    }
}

/// An inpainting or img2img request's inputs, copied out of Python's objects.
pub(crate) struct InpaintArgs {
    pub(crate) source: Reference,
    pub(crate) mask: Option<Reference>,
    /// The mask's fully transparent pixels repaint (OpenAI's edits), not its white ones.
    pub(crate) mask_transparent: bool,
    pub(crate) strength: f64,
    /// `padding_mask_crop`: crop to the mask's region with this padding.
    pub(crate) mask_crop: Option<u32>,
}

impl Reference {
    pub(crate) fn label(&self) -> &Path {
        match self {
            Reference::Path(path) => path,
            Reference::Encoded(_, label) => label,
        }
    }

    /// The label as the image's text stores it (a name that is not UTF-8 with U+FFFD).
    pub(crate) fn label_text(&self) -> String {
        self.label().to_string_lossy().into_owned()
    }

    /// The image as RGB, unprocessed.
    pub(crate) fn decode(&self) -> klein::Result<klein::image::RgbImage> {
        match self {
            Reference::Path(path) => decode_image(path),
            Reference::Encoded(bytes, label) => decode_image_bytes(bytes, label),
        }
    }

    /// A mask as klein's mask image (white repaints): as it is, or, `transparent`, OpenAI's
    /// (its fully transparent pixels repaint).
    pub(crate) fn decode_mask(&self, transparent: bool) -> klein::Result<klein::image::RgbImage> {
        match (self, transparent) {
            (_, false) => self.decode(),
            (Reference::Path(path), true) => load_transparent_mask(path),
            (Reference::Encoded(bytes, label), true) => decode_transparent_mask(bytes, label),
        }
    }
}

impl InpaintArgs {
    /// The source and mask decoded and preprocessed for `pipeline`; an error is the input's
    /// whose file it names (`source` or `mask`, as [`Failure::Input`] names them).
    pub(crate) fn load(&self, pipeline: &Pipeline) -> Result<Inpaint, Failure> {
        let source_err = |e| Failure::Input(e, "source");
        let mask_err = |e| Failure::Input(e, "mask");
        if let (Some(padding), Some(mask)) = (self.mask_crop, &self.mask) {
            let (source_label, mask_label) = (self.source.label(), mask.label());
            let source = self.source.decode().map_err(source_err)?;
            let mask_rgb = mask.decode_mask(self.mask_transparent).map_err(mask_err)?;
            // Its errors are the mask's (its region, its size against the source's) but for
            // the source's size, which names the source.
            return pipeline
                .crop_to_mask(
                    source,
                    mask_rgb,
                    padding,
                    self.strength,
                    (source_label, mask_label),
                )
                .map_err(|e| match &e {
                    KleinError::Image { path, .. }
                        if source_label != mask_label && path == source_label =>
                    {
                        source_err(e)
                    }
                    _ => mask_err(e),
                });
        }
        let source = match &self.source {
            Reference::Path(path) => pipeline.load_source(path),
            Reference::Encoded(bytes, label) => pipeline.decode_source(bytes, label),
        }
        .map_err(source_err)?;
        let mask = match &self.mask {
            None => None,
            Some(mask) => {
                let rgb = mask.decode_mask(self.mask_transparent).map_err(mask_err)?;
                Some(pipeline.prepare_mask(&rgb, &source))
            }
        };
        Ok(Inpaint::new(source, mask, self.strength))
    }
}
