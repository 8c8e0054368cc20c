//! FLUX.3 Image Klein's single reference, kept whole (`Flux3ImageProcessor.preprocess` with
//! `resize_mode="fill"`), reproduced to the bit:
//!
//! 1. The image is decoded as `load_image` does (the module doc of `reference`, step 1).
//! 2. `_resize_if_canvas_exceeds_area`: `scale = min(1, sqrt(4 MP / (w*h)), 4096 / max(w, h))`;
//!    the sides are `max(1, round(side * scale))` (Python's `round`: halves to even), and the
//!    scale is multiplied by 0.995 until the canvas of those sides fits in 4 megapixels. A
//!    changed size is resized with Pillow's LANCZOS.
//! 3. The canvas: each side rounded up to 16, at least 64 and at most 4096 (`reference_canvas`).
//! 4. `_resize_and_fill`: the image centred on the canvas (offsets floored), the rest numpy's
//!    `reflect` padding (`symmetric` when a side is 16 px or less).
//! 5. `x / 255 * 2 - 1`, as every reference. The output defaults to the canvas, and the decoded
//!    image is cropped back to the image's box ([`ReferenceImage::crop_box`]).
use std::path::Path;

use image::RgbImage;
use ndarray::Array4;

use super::{image_error, resize, ReferenceImage};
use crate::error::Result;
use crate::limits::{FLUX3_MAX_CANVAS_AREA, FLUX3_MAX_CANVAS_SIDE, FLUX3_MIN_CANVAS_SIDE};

/// Where a `width` x `height` reference goes: its size once resized, and its canvas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FillPlan {
    /// `(width, height)` after step 2 (the image's own when it fits).
    pub resized: (u32, u32),
    /// `(width, height)` of the canvas (step 3).
    pub canvas: (u32, u32),
}

/// A side's canvas: rounded up to `multiple`, clamped to `[64, 4096]`.
fn canvas_side(side: u32, multiple: u32) -> u32 {
    side.div_ceil(multiple)
        .saturating_mul(multiple)
        .clamp(FLUX3_MIN_CANVAS_SIDE, FLUX3_MAX_CANVAS_SIDE)
}

/// Steps 2 and 3 for a `width` x `height` image (`multiple`: the bundle's 16).
pub fn fill_plan(width: u32, height: u32, multiple: u32) -> FillPlan {
    let (w, h) = (f64::from(width), f64::from(height));
    let area = FLUX3_MAX_CANVAS_AREA as f64;
    let mut scale = 1f64
        .min((area / (w * h)).sqrt())
        .min(f64::from(FLUX3_MAX_CANVAS_SIDE) / w.max(h));
    loop {
        let side = |s: f64| ((s * scale).round_ties_even() as u32).max(1);
        let resized = (side(w), side(h));
        let canvas = (
            canvas_side(resized.0, multiple),
            canvas_side(resized.1, multiple),
        );
        if u64::from(canvas.0) * u64::from(canvas.1) <= FLUX3_MAX_CANVAS_AREA {
            return FillPlan { resized, canvas };
        }
        scale *= 0.995;
    }
}

/// numpy's `np.pad` index for position `i` (relative to the image's first pixel, possibly
/// outside it) of an axis of `n` pixels: `reflect` (the edge pixel not repeated) or `symmetric`.
fn padded_index(i: i64, n: i64, reflect: bool) -> usize {
    let period = if reflect { 2 * (n - 1) } else { 2 * n };
    if period == 0 {
        return 0;
    }
    let j = i.rem_euclid(period);
    let k = match (j < n, reflect) {
        (true, _) => j,
        (false, true) => period - j,
        (false, false) => period - 1 - j,
    };
    k as usize
}

/// Steps 2-5 on a decoded RGB image: the canvas as the VAE takes it, with the image's box.
pub fn fill_reference(rgb: &RgbImage, multiple: u32, label: &Path) -> Result<ReferenceImage> {
    let (width, height) = rgb.dimensions();
    if width == 0 || height == 0 || multiple == 0 {
        return Err(image_error(label)(format!(
            "{width}x{height} has no pixels to encode"
        )));
    }
    let plan = fill_plan(width, height, multiple);
    let resized;
    let image = if plan.resized == (width, height) {
        rgb
    } else {
        resized = resize::resize_lanczos(rgb, plan.resized.0, plan.resized.1);
        &resized
    };
    let (w, h) = plan.resized;
    let (canvas_w, canvas_h) = plan.canvas;
    let (left, top) = ((canvas_w - w) / 2, (canvas_h - h) / 2);
    let reflect = w.min(h) > multiple;
    let pixels = Array4::from_shape_fn(
        (1, 3, canvas_h as usize, canvas_w as usize),
        |(_, c, y, x)| {
            let sx = padded_index(x as i64 - i64::from(left), i64::from(w), reflect);
            let sy = padded_index(y as i64 - i64::from(top), i64::from(h), reflect);
            let value = image.get_pixel(sx as u32, sy as u32)[c];
            2.0 * (f32::from(value) / 255.0) - 1.0
        },
    );
    Ok(ReferenceImage {
        width: canvas_w,
        height: canvas_h,
        pixels,
        crop_box: Some([left, top, left + w, top + h]),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_follows_numpy() {
        // np.pad(np.arange(5), (7, 7), "reflect") and "symmetric"
        let reflect: Vec<usize> = (-7..12).map(|i| padded_index(i, 5, true)).collect();
        assert_eq!(
            reflect,
            [1, 2, 3, 4, 3, 2, 1, 0, 1, 2, 3, 4, 3, 2, 1, 0, 1, 2, 3]
        );
        let symmetric: Vec<usize> = (-7..12).map(|i| padded_index(i, 5, false)).collect();
        assert_eq!(
            symmetric,
            [3, 4, 4, 3, 2, 1, 0, 0, 1, 2, 3, 4, 4, 3, 2, 1, 0, 0, 1]
        );
    }

    #[test]
    fn canvases_fit_four_megapixels() {
        // Small images are kept; the canvas is at least 64 px a side.
        assert_eq!(
            fill_plan(30, 100, 16),
            FillPlan {
                resized: (30, 100),
                canvas: (64, 112)
            }
        );
        // A 12-megapixel photo: scaled under 4 MP, canvas included.
        let plan = fill_plan(4032, 3024, 16);
        assert!(u64::from(plan.canvas.0) * u64::from(plan.canvas.1) <= FLUX3_MAX_CANVAS_AREA);
        assert!(plan.canvas.0.is_multiple_of(16) && plan.canvas.1.is_multiple_of(16));
        // A long side over 4096 is brought to it.
        assert!(fill_plan(10000, 100, 16).resized.0 <= 4096);
    }
}
