//! Tiled VAE decoding and encoding, as diffusers' `AutoencoderKLFlux2` with `enable_tiling()`:
//! overlapping tiles, each blended linearly into the tiles above and to its left (which were
//! blended already: diffusers blends in place, in row order), then cropped and stitched. Only
//! a tile at a time goes through the graph, so the decoder's activations (and its mid-block
//! attention, quadratic in the tile's latent cells) stay those of one tile.
//!
//! diffusers tiles the VAE latent `z` (`[B, 32, H/8, W/8]`); the bundle's graphs take and give the
//! normalised patchified latents (`[B, 128, H/16, W/16]`). Both are the same numbers: the
//! normalisation is an affine map per element (unchanged by a convex blend of two values at the
//! same position) and patchifying a permutation of 2x2 cells, so tiles that start on even cells
//! of `z` are slices of the patchified latents ([`patchify`], [`unpatchify`]).
use ndarray::{concatenate, s, Array4, ArrayView4, Axis};

use crate::error::{KleinError, Result};
use crate::limits::MAX_SIDE;

/// diffusers' `tile_overlap_factor`.
pub const OVERLAP_FACTOR: f64 = 0.25;

/// A tile side asked for (`--vae-tile-size`), checked without a bundle: a multiple of 64 pixels
/// up to [`MAX_SIDE`], so that tiles and their strides fall on whole 2x2 latent patches and
/// 16-pixel blocks. The pipeline checks the bundle's own alignment again when it loads.
pub fn check_tile_size(pixels: u32) -> Result<()> {
    if pixels == 0 || !pixels.is_multiple_of(64) || pixels > MAX_SIDE {
        return Err(KleinError::request_about("vae_tile_size", format!(
            "VAE tile size {pixels}: give a multiple of 64 pixels up to {MAX_SIDE} (tiles and their \
             strides must fall on whole 2x2 latent patches and 16-pixel blocks)"
        )));
    }
    Ok(())
}

/// The tiles along one side: where each starts, how long each is, and how the results join.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TileLayout {
    /// Side of a tile in the input (latent cells of `z` for the decoder, pixels for the encoder).
    pub tile: usize,
    /// Distance between tile starts in the input.
    pub stride: usize,
    /// Rows (columns) of the output blended with the tile above (to the left).
    pub blend: usize,
    /// Rows (columns) of each tile's output kept.
    pub keep: usize,
}

impl TileLayout {
    /// `tiled_decode`: tiles of `sample_size / spatial_factor` latent cells, outputs of
    /// `sample_size` pixels.
    pub fn decoder(sample_size: usize, spatial_factor: usize) -> TileLayout {
        let tile_latent = sample_size / spatial_factor;
        let blend = (sample_size as f64 * OVERLAP_FACTOR) as usize;
        TileLayout {
            tile: tile_latent,
            stride: (tile_latent as f64 * (1.0 - OVERLAP_FACTOR)) as usize,
            blend,
            keep: sample_size - blend,
        }
    }

    /// `_tiled_encode`: tiles of `sample_size` pixels, outputs of `sample_size / spatial_factor`
    /// latent cells.
    pub fn encoder(sample_size: usize, spatial_factor: usize) -> TileLayout {
        let tile_latent = sample_size / spatial_factor;
        let blend = (tile_latent as f64 * OVERLAP_FACTOR) as usize;
        TileLayout {
            tile: sample_size,
            stride: (sample_size as f64 * (1.0 - OVERLAP_FACTOR)) as usize,
            blend,
            keep: tile_latent - blend,
        }
    }

    /// Tile starts along a side of `len`: `range(0, len, stride)`.
    pub fn starts(&self, len: usize) -> Vec<usize> {
        (0..len).step_by(self.stride.max(1)).collect()
    }

    /// Whether every tile start and end falls on a multiple of `multiple` (so that tiles are
    /// slices of what the graphs take): checked before tiling, with the sizes named.
    pub fn check_aligned(&self, multiple: usize, what: &str) -> Result<()> {
        if self.stride == 0
            || !self.tile.is_multiple_of(multiple)
            || !self.stride.is_multiple_of(multiple)
        {
            return Err(KleinError::request(format!(
                "VAE tiling: the bundle's {what} tiles ({} wide, every {}) are not multiples of \
                 {multiple}; decode without tiling (vae.sample_size in the manifest sets them)",
                self.tile, self.stride
            )));
        }
        Ok(())
    }
}

/// `[B, 128, h, w] -> [B, 32, 2h, 2w]`: diffusers' `_unpatchify_latents` (channel `4c + 2dy + dx`
/// is cell `(2y + dy, 2x + dx)` of channel `c`).
pub fn unpatchify(x: ArrayView4<f32>) -> Array4<f32> {
    let (b, c4, h, w) = x.dim();
    Array4::from_shape_fn((b, c4 / 4, 2 * h, 2 * w), |(n, c, y, x_)| {
        x[[n, 4 * c + 2 * (y % 2) + x_ % 2, y / 2, x_ / 2]]
    })
}

/// `[B, 32, 2h, 2w] -> [B, 128, h, w]`: diffusers' `_patchify_latents`.
pub fn patchify(x: ArrayView4<f32>) -> Array4<f32> {
    let (b, c, h2, w2) = x.dim();
    Array4::from_shape_fn((b, 4 * c, h2 / 2, w2 / 2), |(n, ch, y, x_)| {
        let (c, dy, dx) = (ch / 4, (ch / 2) % 2, ch % 2);
        x[[n, c, 2 * y + dy, 2 * x_ + dx]]
    })
}

/// Blends the rows of `grid` (tile outputs `[B, C, th, tw]`, row by row) as diffusers does, crops
/// each to `keep` rows and columns, and joins them: `[B, C, H, W]`.
pub fn stitch(mut grid: Vec<Vec<Array4<f32>>>, blend: usize, keep: usize) -> Result<Array4<f32>> {
    for i in 0..grid.len() {
        for j in 0..grid[i].len() {
            if i > 0 {
                let (above, rest) = grid.split_at_mut(i);
                blend_rows(above[i - 1][j].view(), &mut rest[0][j], blend);
            }
            if j > 0 {
                let (left, rest) = grid[i].split_at_mut(j);
                blend_columns(left[j - 1].view(), &mut rest[0], blend);
            }
        }
    }
    let rows = grid
        .iter()
        .map(|row| {
            let cropped: Vec<ArrayView4<f32>> = row
                .iter()
                .map(|t| t.slice(s![.., .., ..keep.min(t.dim().2), ..keep.min(t.dim().3)]))
                .collect();
            concatenate(Axis(3), &cropped)
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(tile_error)?;
    let views: Vec<ArrayView4<f32>> = rows.iter().map(|r| r.view()).collect();
    concatenate(Axis(2), &views).map_err(tile_error)
}

fn tile_error(error: ndarray::ShapeError) -> KleinError {
    KleinError::Inference {
        stage: "VAE tiling",
        message: format!("joining tiles: {error}"),
    }
}

/// `blend_v`: the first `extent` rows of `tile` fade in from the last rows of `above`.
fn blend_rows(above: ArrayView4<f32>, tile: &mut Array4<f32>, extent: usize) {
    let extent = extent.min(above.dim().2).min(tile.dim().2);
    let offset = above.dim().2 - extent;
    for y in 0..extent {
        let t = y as f64 / extent as f64;
        let (wa, wb) = ((1.0 - t) as f32, t as f32);
        let from = above.slice(s![.., .., offset + y, ..]);
        let mut row = tile.slice_mut(s![.., .., y, ..]);
        row.zip_mut_with(&from, |b, &a| *b = a * wa + *b * wb);
    }
}

/// `blend_h`: the first `extent` columns of `tile` fade in from the last columns of `left`.
fn blend_columns(left: ArrayView4<f32>, tile: &mut Array4<f32>, extent: usize) {
    let extent = extent.min(left.dim().3).min(tile.dim().3);
    let offset = left.dim().3 - extent;
    for x in 0..extent {
        let t = x as f64 / extent as f64;
        let (wa, wb) = ((1.0 - t) as f32, t as f32);
        let from = left.slice(s![.., .., .., offset + x]);
        let mut column = tile.slice_mut(s![.., .., .., x]);
        column.zip_mut_with(&from, |b, &a| *b = a * wa + *b * wb);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    #[test]
    fn layouts_are_diffusers_numbers() {
        // The real VAE (sample_size 1024, 8x): 128-cell tiles every 96, 256 px blended, 768 kept.
        let d = TileLayout::decoder(1024, 8);
        assert_eq!((d.tile, d.stride, d.blend, d.keep), (128, 96, 256, 768));
        let e = TileLayout::encoder(1024, 8);
        assert_eq!((e.tile, e.stride, e.blend, e.keep), (1024, 768, 32, 96));
        assert_eq!(d.starts(200), [0, 96, 192]);
        assert!(d.check_aligned(2, "decoder").is_ok());
        assert!(TileLayout::decoder(72, 8)
            .check_aligned(2, "decoder")
            .is_err()); // 9 cells
    }

    #[test]
    fn patchify_inverts_unpatchify() {
        let x = Array4::from_shape_fn((2, 8, 3, 5), |(a, b, c, d)| {
            (a * 1000 + b * 100 + c * 10 + d) as f32
        });
        let z = unpatchify(x.view());
        assert_eq!(z.dim(), (2, 2, 6, 10));
        // Channel 4c + 2dy + dx of cell (y, x) is z[c, 2y + dy, 2x + dx].
        assert_eq!(z[[1, 1, 3, 4]], x[[1, 4 + 2, 1, 2]]); // c 1, dy 1, dx 0
        assert_eq!(patchify(z.view()), x);
    }

    #[test]
    fn a_constant_image_stays_constant_and_sizes_add_up() {
        // Tiles of a constant: blending two equal values gives the value.
        let layout = TileLayout::decoder(64, 8); // 8-cell tiles every 6: 64 px out, 16 blended
        let (h, w) = (20, 13); // cells of z
        let grid: Vec<Vec<Array4<f32>>> = layout
            .starts(h)
            .iter()
            .map(|&i| {
                layout
                    .starts(w)
                    .iter()
                    .map(|&j| {
                        let (th, tw) = ((h - i).min(layout.tile), (w - j).min(layout.tile));
                        Array4::from_elem((1, 3, 8 * th, 8 * tw), 0.5)
                    })
                    .collect()
            })
            .collect();
        let out = stitch(grid, layout.blend, layout.keep).unwrap();
        assert_eq!(out.dim(), (1, 3, 8 * h, 8 * w));
        assert!(out.iter().all(|&v| (v - 0.5).abs() < 1e-6));
    }

    #[test]
    fn blends_fade_linearly_and_in_place() {
        // Two tiles side by side, 0 and 1: the second's first 4 columns go 0, 0.25, 0.5, 0.75.
        let left = Array4::<f32>::zeros((1, 1, 2, 6));
        let right = Array4::<f32>::ones((1, 1, 2, 6));
        let out = stitch(vec![vec![left, right]], 4, 2).unwrap();
        assert_eq!(out.dim(), (1, 1, 2, 4));
        assert_eq!(out.slice(s![0, 0, 0, ..]).to_vec(), [0.0, 0.0, 0.0, 0.25]);
        // Below a blended tile, the blend reads the blended values (diffusers mutates in place).
        let grid = vec![
            vec![Array4::zeros((1, 1, 4, 4)), Array4::ones((1, 1, 4, 4))],
            vec![
                Array4::from_elem((1, 1, 4, 4), 2.0),
                Array4::from_elem((1, 1, 4, 4), 2.0),
            ],
        ];
        let out = stitch(grid, 2, 4).unwrap();
        // Row 4 (first of the second tile row), column 4 (first of the second tile column): the
        // tile (1,1) blended with (0,1) at weight 0 -> (0,1)'s last row at column 0, which was
        // blended with (0,0) at weight 0 -> 0.
        assert_eq!(out[[0, 0, 4, 4]], 0.0);
        // Cell (1, 1) of tile (1,1): blended down (0.5 x (0,1)'s 0.5 + 0.5 x 2 = 1.25), then
        // right (0.5 x (1,0)'s blended 1 + 0.5 x 1.25).
        assert_eq!(out[[0, 0, 5, 5]], 0.5 * 1.0 + 0.5 * (0.5 * 0.5 + 0.5 * 2.0));
    }
}
