//! Stage 3 of [`Pipeline`]: reference images, read from files or bytes
//! ([`Pipeline::prepare`] checks their headers first), preprocessed as diffusers does, and encoded
//! by the VAE encoder (in tiles where the VAE is tiled).
use std::path::Path;

use ndarray::{concatenate, Array3, ArrayView3, Axis};

use super::progress::timed;
use super::vae::{encode_image, encode_tiles};
use super::{internal, ImageInput, Pipeline, ProgressFn, ReferenceTokens, Stage};
use crate::bundle::Component;
use crate::error::Result;
use crate::runtime::give_back_freed_memory;
use crate::stages::latents::{pack_latents, prepare_flux3_image_ids, prepare_image_ids};
use crate::stages::reference::{
    decode_image_bytes, decode_reference_bytes, fill_reference, preprocess_reference,
    ReferenceImage,
};

impl Pipeline {
    /// Reads (a file) or decodes (bytes) a reference image and preprocesses it as diffusers does
    /// (EXIF orientation, alpha, area, crop). A request's references are best loaded by
    /// [`Pipeline::prepare`], which checks them all from their headers first.
    pub fn load_reference(&self, image: &ImageInput) -> Result<ReferenceImage> {
        self.decode_reference(&image.read()?, image.label())
    }

    /// Decodes and preprocesses the bytes of a PNG, JPEG or WebP file; `label` names it in errors.
    pub(super) fn decode_reference(&self, bytes: &[u8], label: &Path) -> Result<ReferenceImage> {
        decode_reference_bytes(
            bytes,
            &self.manifest.references.limits,
            self.manifest.latents.pixel_multiple,
            label,
        )
    }

    /// FLUX.3's single reference, kept whole on its padded canvas ([`fill_reference`]), from the
    /// bytes of a PNG, JPEG or WebP file. [`Pipeline::prepare`] uses it when a request to a FLUX.3
    /// bundle has one reference; with several, each is [`Pipeline::load_reference`]'s.
    pub fn decode_single_reference(&self, bytes: &[u8], label: &Path) -> Result<ReferenceImage> {
        let rgb = decode_image_bytes(bytes, label)?;
        fill_reference(&rgb, self.manifest.latents.pixel_multiple, label)
    }

    /// Preprocesses an already decoded reference image; `label` names it in errors.
    pub fn prepare_reference(
        &self,
        image: &image::DynamicImage,
        label: &Path,
    ) -> Result<ReferenceImage> {
        preprocess_reference(
            image,
            &self.manifest.references.limits,
            self.manifest.latents.pixel_multiple,
            label,
        )
    }

    /// Stage 3: VAE-encodes each reference (one at a time, as diffusers) and packs them in order.
    pub fn encode_references(
        &mut self,
        references: &[ReferenceImage],
        mut progress: Option<&mut ProgressFn<'_>>,
    ) -> Result<ReferenceTokens> {
        let channels = self.manifest.latents.channels;
        let scale = self.manifest.references.time_offset_scale;
        let bucket = match references.first() {
            Some(first) => self.bucket_of_size(first.width, first.height)?,
            None => None,
        };
        let tiled = references
            .iter()
            .map(|r| self.vae_tiles(r.width as usize, r.height as usize))
            .collect::<Result<Vec<bool>>>()?;
        let layout = tiled
            .iter()
            .any(|&t| t)
            .then(|| self.vae_layout(false))
            .transpose()?;
        let _heap = layout.is_some().then(give_back_freed_memory);
        let packing = self.manifest.latents;
        let graph = self.graph(Component::VaeEncoder, bucket, &mut progress)?;
        let (tokens, grids) = timed(&mut progress, Stage::EncodeReferences, |_| {
            let mut packed = Vec::with_capacity(references.len());
            let mut grids = Vec::with_capacity(references.len());
            for (index, (reference, &tiled)) in references.iter().zip(&tiled).enumerate() {
                // The last one frees the encoder's arena. [1, 128, h, w]:
                let last = (index + 1 == references.len()).then_some(&packing);
                let latents = match layout.filter(|_| tiled) {
                    Some(layout) => encode_tiles(graph, reference.pixels.view(), layout, last)?,
                    None => encode_image(graph, reference.pixels.view(), last)?,
                };
                grids.push((latents.dim().2, latents.dim().3));
                packed.push(pack_latents(latents.view())); // -> [1, h*w, 128]
            }
            let views: Vec<ArrayView3<f32>> = packed.iter().map(|p| p.view()).collect();
            let tokens = if views.is_empty() {
                Array3::zeros((1, 0, channels))
            } else {
                // [1, N, 128]
                concatenate(Axis(1), &views).map_err(|e| internal("reference tokens", e))?
            };
            Ok((tokens, grids))
        })?;
        let ids = match self.is_flux3() {
            true => prepare_flux3_image_ids(&grids),
            false => prepare_image_ids(&grids, scale),
        };
        Ok(ReferenceTokens {
            tokens,
            ids,
            count: grids.len(),
        })
    }
}
