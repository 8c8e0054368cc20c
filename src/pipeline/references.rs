//! Stage 3 of [`Pipeline`]: reference images, read from files or bytes (headers first, so that
//! sizes and the token budget are checked before any pixel is decoded), preprocessed as diffusers
//! does, and encoded by the VAE encoder (in tiles where the VAE is tiled).
use std::borrow::Cow;
use std::path::Path;

use ndarray::{concatenate, Array3, ArrayView3, Axis};

use super::progress::timed;
use super::vae::{encode_image, encode_tiles};
use super::{internal, request, Pipeline, ProgressFn, ReferenceSource, ReferenceTokens, Stage};
use crate::bundle::Component;
use crate::error::Result;
use crate::runtime::give_back_freed_memory;
use crate::stages::latents::{pack_latents, prepare_image_ids};
use crate::stages::reference::{
    decode_reference_bytes, load_reference, preprocess_reference, processed_size, read_file,
    read_header_bytes, ImageHeader, ReferenceImage,
};

impl Pipeline {
    /// Reads and preprocesses a reference image file (EXIF orientation, alpha, area, crop).
    pub fn load_reference(&self, path: &Path) -> Result<ReferenceImage> {
        load_reference(
            path,
            &self.manifest.references.limits,
            self.manifest.latents.pixel_multiple,
        )
    }

    /// Decodes and preprocesses the bytes of a PNG, JPEG or WebP file as [`Self::load_reference`]
    /// does for a file (an upload, an image held in memory); `label` names it in errors.
    pub fn decode_reference(&self, bytes: &[u8], label: &Path) -> Result<ReferenceImage> {
        decode_reference_bytes(
            bytes,
            &self.manifest.references.limits,
            self.manifest.latents.pixel_multiple,
            label,
        )
    }

    /// Reads each reference file once, checks them all as [`Self::load_references`] does before
    /// any is decoded, then decodes and preprocesses them in order. Files that can be read only
    /// once (a pipe, a shell's `<(...)`) work here.
    pub fn load_reference_files(
        &self,
        paths: &[&Path],
        width: Option<u32>,
        height: Option<u32>,
    ) -> Result<Vec<ReferenceImage>> {
        let sources: Vec<_> = paths.iter().map(|&p| ReferenceSource::File(p)).collect();
        self.load_references(&sources, width, height)
    }

    /// Reference images from files (each read once) or from files' bytes, checked from their
    /// headers before any is decoded: each readable and of a size the pipeline takes, at most
    /// [`crate::limits::MAX_REFERENCES`] of them, and the output (`width` x `height`, else the
    /// first reference's size, else the bundle's default) plus all of them within the token
    /// budget; then decoded and preprocessed in order.
    pub fn load_references(
        &self,
        sources: &[ReferenceSource<'_>],
        width: Option<u32>,
        height: Option<u32>,
    ) -> Result<Vec<ReferenceImage>> {
        request::check_reference_count(sources.len())?;
        let files = sources
            .iter()
            .map(|source| match *source {
                ReferenceSource::File(path) => Ok((Cow::Owned(read_file(path)?), path)),
                ReferenceSource::Encoded(bytes, label) => Ok((Cow::Borrowed(bytes), label)),
            })
            .collect::<Result<Vec<_>>>()?;
        let headers = files
            .iter()
            .map(|(bytes, path)| Ok((read_header_bytes(bytes, path)?, *path)))
            .collect::<Result<Vec<_>>>()?;
        self.check_reference_sizes(&headers, width, height)?;
        files
            .iter()
            .map(|(bytes, path)| self.decode_reference(bytes, path))
            .collect()
    }

    /// The size checks of [`Self::load_references`], on headers already read.
    fn check_reference_sizes(
        &self,
        headers: &[(ImageHeader, &Path)],
        width: Option<u32>,
        height: Option<u32>,
    ) -> Result<()> {
        let m = self.manifest.latents.pixel_multiple;
        let mut sizes = Vec::with_capacity(headers.len());
        for &(ref header, path) in headers {
            sizes.push(processed_size(
                header.width,
                header.height,
                &self.manifest.references.limits,
                m,
                path,
            )?);
        }
        let first = sizes.first().copied();
        let width = width
            .or(first.map(|s| s.0))
            .unwrap_or(self.manifest.model.default_width);
        let height = height
            .or(first.map(|s| s.1))
            .unwrap_or(self.manifest.model.default_height);
        let tokens: usize = sizes.iter().map(|&(w, h)| (w / m * (h / m)) as usize).sum();
        request::check_token_budget((width / m * (height / m)) as usize, tokens, sizes.len())
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
        Ok(ReferenceTokens {
            tokens,
            ids: prepare_image_ids(&grids, scale),
            count: grids.len(),
        })
    }
}
