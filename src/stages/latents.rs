//! Position ids and token packing, after the static helpers of diffusers' `Flux2KleinPipeline`
//! (`_prepare_text_ids`, `_prepare_latent_ids`, `_prepare_image_ids`, `_pack_latents`,
//! `_unpack_latents_with_ids`).
//!
//! Ids have 4 axes (T, H, W, L), int64, one row per token, shared by every batch row (the transformer
//! graph takes them 2-D, see onnx/README.md):
//! - text token l: `(0, 0, 0, l)`;
//! - output latent at grid row y, column x: `(0, y, x, 0)`, token index `y*w + x`;
//! - reference image i (0-based) over its own grid: `(scale + scale*i, y, x, 0)`.
use ndarray::{Array2, Array3, Array4, ArrayView3, ArrayView4};

use crate::error::{KleinError, Result};

/// Columns of a position id row: T, H, W, L.
const ID_AXES: usize = 4;

/// `_prepare_text_ids`: `[seq_len, 4]` rows `(0, 0, 0, l)`.
pub fn prepare_text_ids(seq_len: usize) -> Array2<i64> {
    // [L, 4]
    Array2::from_shape_fn(
        (seq_len, ID_AXES),
        |(l, axis)| {
            if axis == 3 {
                l as i64
            } else {
                0
            }
        },
    )
}

/// `_prepare_latent_ids` for an `h x w` latent grid: `[h*w, 4]` rows `(0, y, x, 0)` in row-major
/// token order.
pub fn prepare_latent_ids(h: usize, w: usize) -> Array2<i64> {
    grid_ids(0, h, w)
}

/// `_prepare_image_ids`: the ids of reference latents of grid sizes `grids` (`(h, w)` each, in
/// order), concatenated: `[sum(h*w), 4]`, image i at `T = scale + scale*i` (diffusers' default
/// scale is 10; the manifest's `references.time_offset_scale`).
pub fn prepare_image_ids(grids: &[(usize, usize)], scale: i64) -> Array2<i64> {
    let total: usize = grids.iter().map(|&(h, w)| h * w).sum();
    let mut ids = Array2::zeros((total, ID_AXES));
    let mut start = 0;
    for (i, &(h, w)) in grids.iter().enumerate() {
        let t = scale + scale * i as i64;
        // rows [start, start + h*w) of [total, 4]
        ids.slice_mut(ndarray::s![start..start + h * w, ..])
            .assign(&grid_ids(t, h, w));
        start += h * w;
    }
    ids
}

/// FLUX.3's reference ids (`Flux3PrepareImageCondLatentsStep`): image i (0-based) over its own
/// grid at rows `(0, y, x, -(1 + i))`, concatenated (the transformer graph scales y and x by the
/// recipe's 0.5).
pub fn prepare_flux3_image_ids(grids: &[(usize, usize)]) -> Array2<i64> {
    let total: usize = grids.iter().map(|&(h, w)| h * w).sum();
    let mut ids = Array2::zeros((total, ID_AXES));
    let mut start = 0;
    for (i, &(h, w)) in grids.iter().enumerate() {
        let mut rows = grid_ids(0, h, w);
        rows.column_mut(3).fill(-(1 + i as i64));
        ids.slice_mut(ndarray::s![start..start + h * w, ..])
            .assign(&rows);
        start += h * w;
    }
    ids
}

/// `[h*w, 4]` rows `(t, y, x, 0)`, token `y*w + x`.
fn grid_ids(t: i64, h: usize, w: usize) -> Array2<i64> {
    Array2::from_shape_fn((h * w, ID_AXES), |(token, axis)| match axis {
        0 => t,
        1 => (token / w) as i64,
        2 => (token % w) as i64,
        _ => 0,
    })
}

/// `_pack_latents`: `[B, C, h, w] -> [B, h*w, C]`, token `y*w + x`.
pub fn pack_latents(latents: ArrayView4<f32>) -> Array3<f32> {
    let (batch, channels, h, w) = latents.dim();
    // [B, C, h, w] -> [B, C, h*w] -> permute (0, 2, 1) -> [B, h*w, C]
    Array3::from_shape_fn((batch, h * w, channels), |(b, token, c)| {
        latents[[b, c, token / w, token % w]]
    })
}

/// The inverse of [`pack_latents`]: `[B, h*w, C] -> [B, C, h, w]`. diffusers'
/// `_unpack_latents_with_ids` scatters by the ids of [`prepare_latent_ids`], which is this reshape.
/// Fails when the token count is not `h*w`.
pub fn unpack_latents(tokens: ArrayView3<f32>, h: usize, w: usize) -> Result<Array4<f32>> {
    let (batch, count, channels) = tokens.dim();
    if count != h * w {
        return Err(KleinError::Inference {
            stage: "unpack latents",
            message: format!(
                "expected {h}x{w} = {} latent tokens, got {count} (tokens shape {:?})",
                h * w,
                tokens.shape()
            ),
        });
    }
    // [B, h*w, C] -> permute (0, 2, 1) -> [B, C, h*w] -> [B, C, h, w]
    Ok(Array4::from_shape_fn(
        (batch, channels, h, w),
        |(b, c, y, x)| tokens[[b, y * w + x, c]],
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;
    use ndarray::array;

    // Expected values printed by diffusers 0.42.1's own helpers (Flux2KleinPipeline._prepare_*_ids,
    // _pack_latents) on the same inputs; exact comparison.

    #[test]
    fn text_ids_match_diffusers() {
        assert_eq!(
            prepare_text_ids(3),
            array![[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2]]
        );
    }

    #[test]
    fn latent_ids_match_diffusers() {
        assert_eq!(
            prepare_latent_ids(2, 3),
            array![
                [0, 0, 0, 0],
                [0, 0, 1, 0],
                [0, 0, 2, 0],
                [0, 1, 0, 0],
                [0, 1, 1, 0],
                [0, 1, 2, 0]
            ]
        );
    }

    #[test]
    fn image_ids_match_diffusers() {
        let grids = [(1, 2), (2, 1)];
        assert_eq!(
            prepare_image_ids(&grids, 10),
            array![[10, 0, 0, 0], [10, 0, 1, 0], [20, 0, 0, 0], [20, 1, 0, 0]]
        );
        assert_eq!(
            prepare_image_ids(&grids, 7),
            array![[7, 0, 0, 0], [7, 0, 1, 0], [14, 0, 0, 0], [14, 1, 0, 0]]
        );
        assert_eq!(prepare_image_ids(&[], 10).dim(), (0, 4));
    }

    #[test]
    fn pack_matches_diffusers_and_unpack_inverts_it() {
        // torch.arange(24).reshape(2, 3, 2, 2)
        let latents = Array4::from_shape_fn((2, 3, 2, 2), |(b, c, y, x)| {
            (((b * 3 + c) * 2 + y) * 2 + x) as f32
        });
        let packed = pack_latents(latents.view());
        let expected = array![
            [[0., 4., 8.], [1., 5., 9.], [2., 6., 10.], [3., 7., 11.]],
            [
                [12., 16., 20.],
                [13., 17., 21.],
                [14., 18., 22.],
                [15., 19., 23.]
            ]
        ];
        assert_eq!(packed, expected);
        assert_eq!(unpack_latents(packed.view(), 2, 2).unwrap(), latents);
    }

    #[test]
    fn pack_and_unpack_handle_non_square_grids() {
        let latents =
            Array4::from_shape_fn((1, 4, 2, 3), |(_, c, y, x)| (c * 100 + y * 10 + x) as f32);
        let packed = pack_latents(latents.view());
        // token y*w + x = 1*3 + 2 = 5, channel 3
        assert_eq!(packed[[0, 5, 3]], 312.0);
        assert_eq!(unpack_latents(packed.view(), 2, 3).unwrap(), latents);
    }

    #[test]
    fn unpack_refuses_a_wrong_token_count() {
        let tokens = Array3::<f32>::zeros((1, 5, 4));
        let err = unpack_latents(tokens.view(), 2, 3).unwrap_err();
        assert!(matches!(err, KleinError::Inference { .. }), "{err}");
    }
}
