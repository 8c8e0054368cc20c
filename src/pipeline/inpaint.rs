//! Inpainting and img2img inputs ([`Pipeline::load_source`], [`Pipeline::load_mask`],
//! [`Pipeline::crop_to_mask`]) and the per-step blend ([`Blend`]) of diffusers'
//! `Flux2KleinInpaintPipeline`.
use std::path::Path;

use ndarray::{s, Array1, Array3, ArrayView3};

use super::request::{check_mask_crop, MaskCrop};
use super::{ImageInput, Inpaint, MaskKind, Pipeline};
use crate::error::{KleinError, Result};
use crate::stages::inpaint::{blend, scale_noise};
use crate::stages::mask::{decode_transparent_mask, preprocess_mask, Mask};
use crate::stages::mask_crop::{crop_region, resize_and_fill};
use crate::stages::reference::{
    as_reference, decode_image_bytes, preprocess_source, source_size, ReferenceImage,
};
use crate::stages::schedule::Schedule;

impl Pipeline {
    /// Reads (a file) or decodes (bytes) an inpainting or img2img source image and preprocesses
    /// it: above the references' `max_area` resized down, then resized (not cropped) to sides
    /// that are multiples of 16 ([`preprocess_source`]).
    pub fn load_source(&self, image: &ImageInput) -> Result<ReferenceImage> {
        self.source_from(
            &decode_image_bytes(&image.read()?, image.label())?,
            image.label(),
        )
    }

    pub(super) fn source_from(
        &self,
        rgb: &image::RgbImage,
        label: &Path,
    ) -> Result<ReferenceImage> {
        preprocess_source(
            rgb,
            self.manifest.references.limits.max_area,
            self.manifest.latents.pixel_multiple,
            label,
        )
    }

    /// Reads or decodes a mask image for `source` (any size, resized to the source's;
    /// [`preprocess_mask`]): white repaints, or with [`MaskKind::Transparent`] the fully
    /// transparent pixels.
    pub fn load_mask(
        &self,
        image: &ImageInput,
        kind: MaskKind,
        source: &ReferenceImage,
    ) -> Result<Mask> {
        let rgb = decode_mask(&image.read()?, image.label(), kind)?;
        Ok(self.mask_for(&rgb, source))
    }

    /// Inpainting of the mask's region only, as diffusers' `padding_mask_crop`
    /// ([`crate::stages::mask_crop`]): the box around the mask's white, `padding` pixels wider,
    /// grown to the output's aspect ratio, is cut from the source and the mask and resized to
    /// the size the whole source would be generated at; the result is pasted back into the
    /// whole source through the mask, so the output has the source's size. `mask` must have the
    /// source's size. A source above the references' `max_area` is cropped at full resolution
    /// (diffusers crops the downscaled source, and needs a mask of that size). `labels` name
    /// the source and mask in errors.
    pub fn crop_to_mask(
        &self,
        source: image::RgbImage,
        mask: image::RgbImage,
        padding: u32,
        strength: f64,
        labels: (&Path, &Path),
    ) -> Result<Inpaint> {
        let mask_error = |reason: String| KleinError::Image {
            path: labels.1.to_path_buf(),
            reason,
        };
        check_mask_crop(padding)?;
        let (width, height) = source.dimensions();
        if mask.dimensions() != (width, height) {
            return Err(mask_error(format!(
                "the mask is {}x{} and the source image {width}x{height}: cropping to the mask \
                 needs a mask of the source's size (the result is pasted back through it)",
                mask.width(),
                mask.height()
            )));
        }
        let (out_w, out_h) = source_size(
            width,
            height,
            self.manifest.references.limits.max_area,
            self.manifest.latents.pixel_multiple,
            labels.0,
        )?;
        let region = crop_region(&mask, out_w, out_h, padding).ok_or_else(|| {
            mask_error(
                "the mask is black everywhere: there is nothing to repaint, so no region to crop to"
                    .into(),
            )
        })?;
        let image = as_reference(&resize_and_fill(&region.crop(&source), out_w, out_h));
        let region_mask = preprocess_mask(
            &resize_and_fill(&region.crop(&mask), out_w, out_h),
            out_w,
            out_h,
        );
        let mut inpaint = Inpaint::new(image, Some(region_mask), strength);
        inpaint.crop = Some(MaskCrop::new(region, padding, source, mask));
        Ok(inpaint)
    }
}

/// A mask file's bytes as klein's mask image (white repaints), read as `kind` marks it.
pub(super) fn decode_mask(bytes: &[u8], label: &Path, kind: MaskKind) -> Result<image::RgbImage> {
    match kind {
        MaskKind::White => decode_image_bytes(bytes, label),
        MaskKind::Transparent => decode_transparent_mask(bytes, label),
    }
}

/// What inpainting adds to the denoising loop: the source latents, the noise they are mixed with,
/// and the mask's weight per token (`None`: img2img, where the blend keeps every denoised token
/// and is skipped).
#[derive(Debug, Clone)]
pub(crate) struct Blend {
    /// `[1, h*w, 128]` packed source latents.
    image: Array3<f32>,
    /// `[B, h*w, 128]` packed noise of this batch.
    noise: Array3<f32>,
    /// `[h*w]`: 1 repaints, 0 keeps.
    mask: Option<Array1<f32>>,
}

impl Blend {
    /// From the reference tokens (`[1, N, 128]`, the source's `h*w` first) and the batch's packed
    /// noise `[B, h*w, 128]`.
    pub fn new(
        reference_tokens: ArrayView3<f32>,
        noise: Array3<f32>,
        mask: Option<&Mask>,
        lat_h: usize,
        lat_w: usize,
    ) -> Blend {
        let image = reference_tokens
            .slice(s![.., ..lat_h * lat_w, ..])
            .to_owned();
        let mask = mask
            .filter(|m| !m.repaints_everything())
            .map(|m| m.latent_weights(lat_h, lat_w));
        Blend { image, noise, mask }
    }

    /// The latents the first step takes: the source noised to the schedule's first sigma
    /// (`prepare_latents`: `scale_noise(image_latents, timesteps[0], noise)`).
    pub fn initial_latents(&self, schedule: &Schedule) -> Array3<f32> {
        let mut latents = Array3::zeros(self.noise.raw_dim());
        scale_noise(
            latents.view_mut(),
            self.image.view(),
            self.noise.view(),
            schedule.sigma(0),
        );
        latents
    }

    /// After step `step` of `schedule`: the kept tokens become the source noised to the next
    /// sigma (the source itself after the last step).
    pub fn after_step(&self, latents: &mut Array3<f32>, step: usize, schedule: &Schedule) {
        let Some(mask) = &self.mask else {
            return;
        };
        let proper = if step + 1 < schedule.num_steps() {
            let mut noised = Array3::zeros(self.noise.raw_dim());
            scale_noise(
                noised.view_mut(),
                self.image.view(),
                self.noise.view(),
                schedule.sigma(step + 1),
            );
            noised
        } else {
            self.image
                .broadcast(self.noise.raw_dim())
                .unwrap_or_else(|| unreachable!("[1, N, C] broadcasts to [B, N, C]"))
                .to_owned()
        };
        blend(latents.view_mut(), proper.view(), mask.view());
    }
}
