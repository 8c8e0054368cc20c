//! `padding_mask_crop` of diffusers' `Flux2KleinInpaintPipeline` ("inpaint only the masked
//! area"), reproduced to the bit on RGB8 images:
//!
//! 1. [`crop_region`]: `VaeImageProcessor.get_crop_region`, the box around the mask's non-black
//!    pixels, padded, then widened (or heightened) to the aspect ratio of the processing size.
//! 2. The source and the mask are cropped to it and resized to the processing size with
//!    [`resize_and_fill`] (`resize_mode="fill"`: Lanczos to fit, centred, the uncovered strips
//!    filled from the edge rows or columns).
//! 3. After decoding, [`paste_back`] (`apply_overlay`): the generated image is fitted to the box
//!    ([`resize_and_cover`]), and the source is laid over it where the mask is black, with
//!    Pillow's premultiplied paste and `alpha_composite` (soft mask edges blend).
//!
//! One deliberate difference: diffusers 0.42.1's `Flux2ImageProcessor` overrides
//! `_resize_and_crop` with a plain centre crop, so its `apply_overlay` pastes the centre of the
//! generated image (a zoomed-in part) instead of the generated image resized to the box. Here
//! step 3 resizes, as `VaeImageProcessor._resize_and_crop` (every other diffusers inpaint
//! pipeline's paste-back) does.
use image::RgbImage;

use crate::stages::mask::luma;
use crate::stages::reference::{resize_box_like_pillow, resize_like_pillow};

/// A box of the source image (and of its mask, which has the source's size), in pixels:
/// columns `left..right`, rows `top..bottom`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CropRegion {
    pub left: u32,
    pub top: u32,
    pub right: u32,
    pub bottom: u32,
}

impl CropRegion {
    pub fn width(&self) -> u32 {
        self.right - self.left
    }

    pub fn height(&self) -> u32 {
        self.bottom - self.top
    }

    /// The box of `rgb` as a new image (`Image.crop`).
    pub fn crop(&self, rgb: &RgbImage) -> RgbImage {
        image::imageops::crop_imm(rgb, self.left, self.top, self.width(), self.height()).to_image()
    }
}

/// `get_crop_region(mask, width, height, pad)`: the smallest box holding every pixel of `mask`
/// whose grey is not 0, grown by `pad` on each side (within the image), then grown along one
/// axis to the aspect ratio of `width` x `height` (shifted back inside the image at its edges).
/// `None` when the mask is black everywhere (nothing to repaint).
pub fn crop_region(mask: &RgbImage, width: u32, height: u32, pad: u32) -> Option<CropRegion> {
    let (w, h) = mask.dimensions();
    let grey: Vec<u8> = mask.pixels().map(|p| luma(p.0)).collect();
    let column_clear = |x: u32| (0..h).all(|y| grey[(y * w + x) as usize] == 0);
    let row_clear = |y: u32| (0..w).all(|x| grey[(y * w + x) as usize] == 0);
    let left = (0..w).take_while(|&x| column_clear(x)).count() as i64;
    if left == i64::from(w) {
        return None;
    }
    let right = (0..w).rev().take_while(|&x| column_clear(x)).count() as i64;
    let top = (0..h).take_while(|&y| row_clear(y)).count() as i64;
    let bottom = (0..h).rev().take_while(|&y| row_clear(y)).count() as i64;
    let (w, h, pad) = (i64::from(w), i64::from(h), i64::from(pad));
    let (mut x1, mut y1) = ((left - pad).max(0), (top - pad).max(0));
    let (mut x2, mut y2) = ((w - right + pad).min(w), (h - bottom + pad).min(h));

    // Python floats and ints: `int()` truncates, `//` floors.
    let ratio_crop = (x2 - x1) as f64 / (y2 - y1) as f64;
    let ratio_processing = f64::from(width) / f64::from(height);
    let grow = |lo: &mut i64, hi: &mut i64, desired: f64, size: i64| {
        let diff = (desired - (*hi - *lo) as f64) as i64;
        *lo -= diff.div_euclid(2);
        *hi += diff - diff.div_euclid(2);
        if *hi >= size {
            let over = *hi - size;
            *hi -= over;
            *lo -= over;
        }
        if *lo < 0 {
            *hi -= *lo;
            *lo = 0;
        }
        if *hi >= size {
            *hi = size;
        }
    };
    if ratio_crop > ratio_processing {
        grow(&mut y1, &mut y2, (x2 - x1) as f64 / ratio_processing, h);
    } else {
        grow(&mut x1, &mut x2, (y2 - y1) as f64 * ratio_processing, w);
    }
    Some(CropRegion {
        left: x1 as u32,
        top: y1 as u32,
        right: x2 as u32,
        bottom: y2 as u32,
    })
}

/// `Image.paste(src, (x, y))` without a mask: the part of `src` that falls inside `dst`.
fn paste(dst: &mut RgbImage, src: &RgbImage, x: i64, y: i64) {
    let (dw, dh) = (i64::from(dst.width()), i64::from(dst.height()));
    for (sx, sy, pixel) in src.enumerate_pixels() {
        let (tx, ty) = (x + i64::from(sx), y + i64::from(sy));
        if (0..dw).contains(&tx) && (0..dh).contains(&ty) {
            dst.put_pixel(tx as u32, ty as u32, *pixel);
        }
    }
}

/// `VaeImageProcessor._resize_and_fill(rgb, width, height)`: Lanczos to fit inside `width` x
/// `height` keeping the aspect ratio, centred on black; the strips left above and below (or
/// left and right) are filled from the image's first and last rows (columns): Pillow's `resize`
/// of a zero-height (zero-width) box, with its default BICUBIC filter.
pub fn resize_and_fill(rgb: &RgbImage, width: u32, height: u32) -> RgbImage {
    let (iw, ih) = rgb.dimensions();
    let ratio = f64::from(width) / f64::from(height);
    let src_ratio = f64::from(iw) / f64::from(ih);
    let fit_w = if ratio < src_ratio {
        width
    } else {
        iw * height / ih
    };
    let fit_h = if ratio >= src_ratio {
        height
    } else {
        ih * width / iw
    };
    let resized = resize_like_pillow(rgb, fit_w.max(1), fit_h.max(1));
    let (rw, rh) = resized.dimensions();
    let mut out = RgbImage::new(width, height);
    let (off_x, off_y) = (width / 2 - fit_w / 2, height / 2 - fit_h / 2);
    paste(&mut out, &resized, i64::from(off_x), i64::from(off_y));
    if ratio < src_ratio && off_y > 0 {
        let top = resize_box_like_pillow(&resized, width, off_y, [0, 0, width, 0]);
        let bottom = resize_box_like_pillow(&resized, width, off_y, [0, rh, width, rh]);
        paste(&mut out, &top, 0, 0);
        paste(&mut out, &bottom, 0, i64::from(off_y + fit_h));
    } else if ratio > src_ratio && off_x > 0 {
        let left = resize_box_like_pillow(&resized, off_x, height, [0, 0, 0, height]);
        let right = resize_box_like_pillow(&resized, off_x, height, [rw, 0, rw, height]);
        paste(&mut out, &left, 0, 0);
        paste(&mut out, &right, i64::from(off_x + fit_w), 0);
    }
    out
}

/// `VaeImageProcessor._resize_and_crop(rgb, width, height)`: Lanczos to cover `width` x `height`
/// keeping the aspect ratio, centred, the excess cut off.
pub fn resize_and_cover(rgb: &RgbImage, width: u32, height: u32) -> RgbImage {
    let (iw, ih) = rgb.dimensions();
    let ratio = f64::from(width) / f64::from(height);
    let src_ratio = f64::from(iw) / f64::from(ih);
    let fit_w = if ratio > src_ratio {
        width
    } else {
        iw * height / ih
    };
    let fit_h = if ratio <= src_ratio {
        height
    } else {
        ih * width / iw
    };
    let resized = resize_like_pillow(rgb, fit_w.max(1), fit_h.max(1));
    let mut out = RgbImage::new(width, height);
    let off_x = i64::from(width / 2) - i64::from(fit_w / 2);
    let off_y = i64::from(height / 2) - i64::from(fit_h / 2);
    paste(&mut out, &resized, off_x, off_y);
    out
}

/// `(v + 128) / 255` rounded, as Pillow's `DIV255`.
fn div255(v: u32) -> u32 {
    let t = v + 128;
    ((t >> 8) + t) >> 8
}

/// `apply_overlay(mask, source, generated, region)`: `generated` fitted to `region` on black at
/// the source's size, with the source laid over it through the inverted grey of `mask` (black
/// keeps the source, white takes the generated image, grey blends). `source` and `mask` have one
/// size. Pillow's chain per channel, with `a = 255 - grey`: the premultiplied paste
/// `DIV255(source * a)`, its un-premultiplication `255 * p / a`, then `alpha_composite` over the
/// opaque generated pixel in 7-bit fixed point.
pub fn paste_back(
    source: &RgbImage,
    mask: &RgbImage,
    generated: &RgbImage,
    region: CropRegion,
) -> RgbImage {
    let fitted = resize_and_cover(generated, region.width(), region.height());
    let mut under = RgbImage::new(source.width(), source.height());
    paste(
        &mut under,
        &fitted,
        i64::from(region.left),
        i64::from(region.top),
    );
    let mut out = under;
    for ((pixel, kept), shade) in out.pixels_mut().zip(source.pixels()).zip(mask.pixels()) {
        let alpha = 255 - u32::from(luma(shade.0));
        if alpha == 0 {
            continue;
        }
        for (g, &s) in pixel.0.iter_mut().zip(&kept.0) {
            let premultiplied = div255(u32::from(s) * alpha);
            let straight = if alpha == 255 {
                premultiplied
            } else {
                (255 * premultiplied / alpha).min(255)
            };
            let sum = straight * alpha * 128 + u32::from(*g) * (255 - alpha) * 128 + (0x80 << 7);
            *g = ((((sum >> 8) + sum) >> 8) >> 7) as u8;
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    fn mask_with(w: u32, h: u32, white: CropRegion) -> RgbImage {
        RgbImage::from_fn(w, h, |x, y| {
            let inside =
                (white.left..white.right).contains(&x) && (white.top..white.bottom).contains(&y);
            image::Rgb([if inside { 255 } else { 0 }; 3])
        })
    }

    #[test]
    fn crop_region_pads_and_matches_the_aspect_ratio() {
        // A 20x10 white box at (40, 30) in 100x80, padded by 4, for a square processing size:
        // 28x18 grows to 28x28 around its centre.
        let region = CropRegion {
            left: 40,
            top: 30,
            right: 60,
            bottom: 40,
        };
        let got = crop_region(&mask_with(100, 80, region), 64, 64, 4).unwrap();
        assert_eq!(
            got,
            CropRegion {
                left: 36,
                top: 21,
                right: 64,
                bottom: 49
            }
        );
        // Against the bottom edge: shifted up to stay inside.
        let low = CropRegion {
            left: 40,
            top: 76,
            right: 60,
            bottom: 80,
        };
        let got = crop_region(&mask_with(100, 80, low), 64, 64, 0).unwrap();
        assert_eq!(
            (got.top, got.bottom, got.width(), got.height()),
            (60, 80, 20, 20)
        );
        // A black mask repaints nothing.
        assert_eq!(crop_region(&RgbImage::new(8, 8), 16, 16, 2), None);
    }

    #[test]
    fn fill_stretches_the_edges_into_the_strips() {
        // A 16x4 image of two colours (top rows red, bottom rows blue) filled into 16x16: the
        // fitted image is 16x4 in rows 6..10, the strips above and below take its edge rows.
        let rgb = RgbImage::from_fn(16, 4, |_, y| {
            image::Rgb(if y < 2 { [255, 0, 0] } else { [0, 0, 255] })
        });
        let out = resize_and_fill(&rgb, 16, 16);
        // Pillow's values (`VaeImageProcessor()._resize_and_fill`).
        assert_eq!(out.get_pixel(3, 7), &image::Rgb([255, 0, 0]));
        assert_eq!(out.get_pixel(3, 0), &image::Rgb([255, 0, 0]));
        assert_eq!(out.get_pixel(3, 15), &image::Rgb([0, 0, 255]));
        assert!(
            out.pixels().all(|p| p.0 != [0, 0, 0]),
            "no black strip is left"
        );
    }

    #[test]
    fn paste_back_keeps_black_takes_white_and_blends_grey() {
        let source = RgbImage::from_pixel(4, 1, image::Rgb([200, 100, 0]));
        let mask = RgbImage::from_fn(4, 1, |x, _| image::Rgb([[0, 255, 128, 0][x as usize]; 3]));
        let generated = RgbImage::from_pixel(8, 2, image::Rgb([10, 20, 30]));
        let region = CropRegion {
            left: 0,
            top: 0,
            right: 4,
            bottom: 1,
        };
        let out = paste_back(&source, &mask, &generated, region);
        assert_eq!(out.get_pixel(0, 0).0, [200, 100, 0]);
        assert_eq!(out.get_pixel(1, 0).0, [10, 20, 30]);
        // Grey 128: alpha 127, about half of each (Pillow's `apply_overlay` values).
        assert_eq!(out.get_pixel(2, 0).0, [105, 60, 15]);
        assert_eq!(out.get_pixel(3, 0).0, [200, 100, 0]);
    }
}
