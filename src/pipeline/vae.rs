//! Stage 7 of [`Pipeline`] and the VAE passes of stage 3: latents through the decoder and images
//! through the encoder, whole or in tiles ([`crate::stages::vae_tiling`]), as diffusers'
//! `AutoencoderKLFlux2` does with and without tiling.
use ndarray::{s, Array4, ArrayView3, ArrayView4, Ix4};

use super::progress::timed;
use super::{internal, Pipeline, ProgressFn, Stage, VaeTiling};
use crate::bundle::manifest::LatentsSpec;
use crate::bundle::{Component, Manifest};
use crate::error::{KleinError, Result};
use crate::runtime::{give_back_freed_memory, Graph, TensorInput};
use crate::stages::latents::unpack_latents;
use crate::stages::output::{to_rgb_images, RgbImage};
use crate::stages::vae_tiling::{patchify, stitch, unpatchify, TileLayout};

impl Pipeline {
    /// Stage 7: packed latents `[B, h*w, 128]` to images.
    pub fn decode(
        &mut self,
        latents: ArrayView3<f32>,
        lat_h: usize,
        lat_w: usize,
        mut progress: Option<&mut ProgressFn<'_>>,
    ) -> Result<Vec<RgbImage>> {
        let grid = unpack_latents(latents, lat_h, lat_w)?; // [B, h*w, 128] -> [B, 128, h, w]
        let m = self.manifest.latents.pixel_multiple;
        let bucket = self.bucket_of_size(lat_w as u32 * m, lat_h as u32 * m)?;
        let tiled = self.vae_tiles(lat_w * m as usize, lat_h * m as usize)?;
        let layout = tiled.then(|| self.vae_layout(true)).transpose()?;
        // The decoder on glibc's usual heap, whose kept memory goes back first (runtime's heap):
        // the steps' freed activations would otherwise stay under the decoder's own.
        let _heap = give_back_freed_memory();
        let packing = self.manifest.latents;
        let graph = self.graph(Component::VaeDecoder, bucket, &mut progress)?;
        timed(&mut progress, Stage::Decode, |_| {
            // [B, 3, 16h, 16w]
            let decoded = match layout {
                Some(layout) => decode_tiles(graph, grid.view(), layout, &packing)?,
                None => decode_latents(graph, grid.view(), Some(&packing))?,
            };
            Ok(to_rgb_images(decoded.view()))
        })
    }

    /// Whether an image (or reference) of `width` x `height` pixels goes through the VAE in
    /// tiles. Static-shape graphs take their sizes only: `On` is refused there, `Auto` is off.
    pub(super) fn vae_tiles(&self, width: usize, height: usize) -> Result<bool> {
        let tiles = self.vae_tiling.applies(width, height, self.vae_tile);
        if tiles && self.manifest.static_shapes.is_some() {
            if self.vae_tiling == VaeTiling::On {
                return Err(KleinError::request(
                    "VAE tiling needs graphs that take any size; this is a static-shape bundle",
                ));
            }
            return Ok(false);
        }
        Ok(tiles)
    }

    /// The VAE's tiles for the decoder or the encoder ([`vae_layout`]).
    pub(super) fn vae_layout(&self, decoder: bool) -> Result<TileLayout> {
        vae_layout(&self.manifest, self.vae_tile, decoder)
    }
}

/// The tiles of `tile` pixels for the decoder or the encoder, checked to be slices of what the
/// graph takes: even latent cells (the decoder takes 2x2 patches), multiples of the pixel
/// multiple (the encoder's images).
pub(super) fn vae_layout(manifest: &Manifest, tile: usize, decoder: bool) -> Result<TileLayout> {
    let vae = &manifest.vae;
    if decoder {
        let layout = TileLayout::decoder(tile, vae.spatial_factor);
        layout.check_aligned(vae.patch_size, "decoder")?;
        Ok(layout)
    } else {
        let layout = TileLayout::encoder(tile, vae.spatial_factor);
        layout.check_aligned(manifest.latents.pixel_multiple as usize, "encoder")?;
        Ok(layout)
    }
}

/// The VAE tile side: `requested`, checked to give aligned tiles for both graphs, else the
/// bundle's `vae.sample_size`.
pub(super) fn check_vae_tile(manifest: &Manifest, requested: Option<u32>) -> Result<usize> {
    let Some(pixels) = requested else {
        return Ok(manifest.vae.sample_size);
    };
    crate::stages::vae_tiling::check_tile_size(pixels)?;
    let tile = pixels as usize;
    if vae_layout(manifest, tile, true).is_err() || vae_layout(manifest, tile, false).is_err() {
        return Err(KleinError::request_about(
            "vae_tile_size",
            format!(
            "VAE tile size {pixels}: tiles and their strides must fall on whole 2x2 latent patches \
             and 16-pixel blocks of bundle {}",
            manifest.model.name
        ),
        ));
    }
    Ok(tile)
}

/// The whole image through the VAE encoder: `[1, 3, H, W]` -> `[1, 128, H/16, W/16]`.
/// `last`: given for the pass's last run (with the manifest's latent packing, which gives the
/// output's shape), after which the encoder's arena is freed ([`Graph::run_then_free_arena`]).
pub(super) fn encode_image(
    graph: &mut Graph,
    pixels: ArrayView4<f32>,
    last: Option<&LatentsSpec>,
) -> Result<Array4<f32>> {
    let (batch, _, height, width) = pixels.dim();
    let shape = last.map(|packing| packing.latents_shape(batch, height, width));
    run_vae(graph, ("image", pixels), "latents", shape)
}

/// One run of a VAE graph, `input` (its name and value) to the output named `output`; with
/// `last_shape` (that output's shape) the pass's last, after which the graph's arena is freed.
pub(super) fn run_vae(
    graph: &mut Graph,
    (input, value): (&str, ArrayView4<f32>),
    output: &str,
    last_shape: Option<[usize; 4]>,
) -> Result<Array4<f32>> {
    let inputs = [(input, TensorInput::from(value))];
    let mut out = match last_shape {
        Some(shape) => graph.run_then_free_arena(&inputs, &[(output, &shape)])?,
        None => graph.run(&inputs)?,
    };
    out.take(output)?
        .into_dimensionality::<Ix4>()
        .map_err(|e| internal(output, e))
}

/// The image through the encoder in tiles ([`crate::stages::vae_tiling`]): each tile's latents,
/// unpatchified, are blended and joined as diffusers' `_tiled_encode` joins its tiles' moments,
/// then patchified again. `[1, 3, H, W]` -> `[1, 128, H/16, W/16]`. `last_image`: given for the
/// pass's last image, whose last tile frees the encoder's arena (as [`encode_image`]).
pub(super) fn encode_tiles(
    graph: &mut Graph,
    pixels: ArrayView4<f32>,
    layout: TileLayout,
    last_image: Option<&LatentsSpec>,
) -> Result<Array4<f32>> {
    let (_, _, height, width) = pixels.dim();
    let (rows, columns) = (layout.starts(height), layout.starts(width));
    let mut grid = Vec::new();
    for &i in &rows {
        let mut row = Vec::new();
        for &j in &columns {
            let tile = pixels.slice(s![
                ..,
                ..,
                i..(i + layout.tile).min(height),
                j..(j + layout.tile).min(width)
            ]);
            let last_tile = rows.last() == Some(&i) && columns.last() == Some(&j);
            let last = last_image.filter(|_| last_tile);
            row.push(unpatchify(encode_image(graph, tile, last)?.view())); // [1, 32, th/8, tw/8]
        }
        grid.push(row);
    }
    Ok(patchify(stitch(grid, layout.blend, layout.keep)?.view()))
}

/// The latents through the VAE decoder at once: `[B, 128, h, w]` -> `[B, 3, 16h, 16w]`.
/// `last`: given for the pass's last run (with the manifest's latent packing, which gives the
/// output's shape), after which the decoder's arena is freed ([`Graph::run_then_free_arena`]).
pub(super) fn decode_latents(
    graph: &mut Graph,
    latents: ArrayView4<f32>,
    last: Option<&LatentsSpec>,
) -> Result<Array4<f32>> {
    let (batch, _, h, w) = latents.dim();
    let shape = last.map(|packing| packing.image_shape(batch, h, w));
    run_vae(graph, ("latents", latents), "image", shape)
}

/// The latents through the decoder in tiles, as diffusers' `tiled_decode` over `z` (whose tiles
/// of even cells are these latents' tiles of half as many): `[B, 128, h, w]` -> `[B, 3, 16h, 16w]`.
pub(super) fn decode_tiles(
    graph: &mut Graph,
    latents: ArrayView4<f32>,
    layout: TileLayout,
    packing: &LatentsSpec,
) -> Result<Array4<f32>> {
    let (_, _, h, w) = latents.dim();
    let (zh, zw) = (2 * h, 2 * w); // cells of z
    let (rows, columns) = (layout.starts(zh), layout.starts(zw));
    let mut grid = Vec::new();
    for &i in &rows {
        let mut row = Vec::new();
        for &j in &columns {
            let (bottom, right) = ((i + layout.tile).min(zh), (j + layout.tile).min(zw));
            let tile = latents.slice(s![.., .., i / 2..bottom / 2, j / 2..right / 2]);
            let last = rows.last() == Some(&i) && columns.last() == Some(&j);
            // The last tile frees the arena.
            row.push(decode_latents(graph, tile, last.then_some(packing))?);
        }
        grid.push(row);
    }
    stitch(grid, layout.blend, layout.keep)
}
