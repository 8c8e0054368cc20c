//! The inpainting mask of diffusers' `Flux2KleinInpaintPipeline`: its `mask_processor`
//! (`Flux2ImageProcessor(do_normalize=False, do_binarize=True, do_convert_grayscale=True)`) and
//! `prepare_mask_latents`, reproduced to the bit:
//!
//! 1. `load_image`: the file as RGB ([`crate::stages::reference::decode_image`]).
//! 2. `resize((width, height), LANCZOS)` to the source image's processed size (Pillow, on RGB).
//! 3. `convert("L")`: Pillow's `(19595 R + 38470 G + 7471 B + 0x8000) >> 16`.
//! 4. `x / 255` in float32, then binarised: below 0.5 is 0 (kept), else 1 (repainted).
//! 5. `F.interpolate(mask, (H/16, W/16), mode="bilinear")` (half-pixel centres, no antialias) and
//!    packed row-major, one weight per latent token.
use std::path::Path;

use image::RgbImage;
use ndarray::Array1;

use crate::error::Result;
use crate::stages::reference::{image_error, read_file, read_header_bytes, resize_like_pillow};

/// A binarised mask at the source image's processed size: 1 where the image is repainted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mask {
    pub width: u32,
    pub height: u32,
    /// `height * width` values, 0 or 1, row-major.
    pub values: Vec<u8>,
}

/// OpenAI's edits mask as klein's mask image: its fully transparent pixels (alpha 0) become white
/// (repainted), the others black (kept). The bytes of a PNG, JPEG or WebP file within klein's
/// decode bounds, with an alpha channel (refused without one); `label` names it in errors.
pub fn decode_transparent_mask(bytes: &[u8], label: &Path) -> Result<RgbImage> {
    read_header_bytes(bytes, label)?;
    let error = image_error(label);
    let decoded =
        image::load_from_memory(bytes).map_err(|e| error(format!("not a readable image: {e}")))?;
    if !decoded.color().has_alpha() {
        return Err(error(
            "OpenAI's mask is a PNG with an alpha channel (fully transparent pixels are edited); \
             this one has none"
                .into(),
        ));
    }
    let rgba = decoded.to_rgba8();
    Ok(RgbImage::from_fn(rgba.width(), rgba.height(), |x, y| {
        image::Rgb([if rgba.get_pixel(x, y)[3] == 0 { 255 } else { 0 }; 3])
    }))
}

/// [`decode_transparent_mask`] of a file.
pub fn load_transparent_mask(path: &Path) -> Result<RgbImage> {
    decode_transparent_mask(&read_file(path)?, path)
}

/// Steps 2-4 of the module doc: the decoded RGB mask to a binary mask of `width` x `height`.
pub fn preprocess_mask(rgb: &RgbImage, width: u32, height: u32) -> Mask {
    let resized = resize_like_pillow(rgb, width, height);
    let values = resized
        .pixels()
        .map(|p| u8::from(f32::from(luma(p.0)) / 255.0 >= 0.5))
        .collect();
    Mask {
        width,
        height,
        values,
    }
}

/// Pillow's `convert("L")` of one RGB pixel (ITU-R 601-2 luma in 16-bit fixed point, rounded).
pub(crate) fn luma([r, g, b]: [u8; 3]) -> u8 {
    ((u32::from(r) * 19595 + u32::from(g) * 38470 + u32::from(b) * 7471 + 0x8000) >> 16) as u8
}

impl Mask {
    /// Whether no pixel is kept (every value 1): the blend then changes nothing.
    pub fn repaints_everything(&self) -> bool {
        self.values.iter().all(|&v| v == 1)
    }

    /// Step 5 of the module doc: `[H, W]` -> `[lat_h * lat_w]` weights in [0, 1], as torch's
    /// `upsample_bilinear2d` on CPU (align_corners=False) computes them in float32.
    pub fn latent_weights(&self, lat_h: usize, lat_w: usize) -> Array1<f32> {
        let (in_h, in_w) = (self.height as usize, self.width as usize);
        let axis = |in_size: usize, out_size: usize| -> Vec<(usize, usize, f32, f32)> {
            let scale = in_size as f32 / out_size as f32;
            (0..out_size)
                .map(|d| {
                    let src = (scale * (d as f32 + 0.5) - 0.5).max(0.0);
                    let i0 = (src as usize).min(in_size - 1);
                    let i1 = if i0 < in_size - 1 { i0 + 1 } else { i0 };
                    let l1 = src - i0 as f32;
                    (i0, i1, 1.0 - l1, l1)
                })
                .collect()
        };
        let rows = axis(in_h, lat_h);
        let cols = axis(in_w, lat_w);
        let at = |y: usize, x: usize| f32::from(self.values[y * in_w + x]);
        let mut out = Array1::zeros(lat_h * lat_w);
        for (i, &(h0, h1, h0l, h1l)) in rows.iter().enumerate() {
            for (j, &(w0, w1, w0l, w1l)) in cols.iter().enumerate() {
                out[i * lat_w + j] = h0l * (w0l * at(h0, w0) + w1l * at(h0, w1))
                    + h1l * (w0l * at(h1, w0) + w1l * at(h1, w1));
            }
        }
        out
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    #[test]
    fn luma_matches_pillow_at_the_corners_and_rounds() {
        assert_eq!(luma([0, 0, 0]), 0);
        assert_eq!(luma([255, 255, 255]), 255);
        // Pillow: Image.new("RGB", (1, 1), c).convert("L").getpixel((0, 0))
        assert_eq!(luma([255, 0, 0]), 76);
        assert_eq!(luma([0, 255, 0]), 150);
        assert_eq!(luma([0, 0, 255]), 29);
    }

    #[test]
    fn binarises_at_half() {
        let rgb = RgbImage::from_fn(2, 1, |x, _| image::Rgb([127 + x as u8; 3]));
        let mask = preprocess_mask(&rgb, 2, 1);
        assert_eq!(mask.values, vec![0, 1]);
    }

    #[test]
    fn bilinear_weights_read_the_block_centres() {
        // 32x32, repaint the left half: each 16x16 block's centre sample (pixels 7 and 8).
        let mut values = vec![0u8; 32 * 32];
        for y in 0..32 {
            for x in 0..16 {
                values[y * 32 + x] = 1;
            }
        }
        let mask = Mask {
            width: 32,
            height: 32,
            values,
        };
        assert_eq!(mask.latent_weights(2, 2).to_vec(), vec![1.0, 0.0, 1.0, 0.0]);
        assert!(!mask.repaints_everything());
        let mut edge = mask.clone();
        // Pixel (x=8, y=7) and its neighbours decide latent (0, 0): clear one of the four.
        edge.values[7 * 32 + 8] = 0;
        assert_eq!(edge.latent_weights(2, 2)[0], 0.75);
    }
}
