//! Reference images: decoding and the preprocessing of diffusers' `Flux2KleinPipeline` (step 4 of
//! `__call__`), reproduced to the bit:
//!
//! 1. `load_image`: Pillow's decoder for the file, `PIL.ImageOps.exif_transpose`, then
//!    `convert("RGB")` ([`decode_image`]). The contract: the pixels of
//!    `diffusers.utils.load_image(path)`, bit for bit, for every format klein accepts (PNG, JPEG,
//!    WebP; any other is refused with that list). JPEG goes through libjpeg-turbo's decoder, as in
//!    Pillow (`libjpeg`); the orientation is read where Pillow reads it (EXIF, PNG text, XMP);
//!    alpha is dropped, not composited; grey is replicated; 16-bit channels keep their high byte,
//!    except 16-bit grey, which Pillow clips at 255. tests/it/decode.rs proves it on a corpus made
//!    by tests/fixtures/make_decode_corpus.py.
//! 2. `Flux2ImageProcessor.check_image_input`: both sides at least `min_side`, aspect ratio at most
//!    `max_aspect_ratio`.
//! 3. If `w*h > max_area`: `_resize_to_target_area`, sides `int(w*s)`, `int(h*s)` with
//!    `s = sqrt(max_area / (w*h))`, Pillow's LANCZOS (`resize`, bit-exact).
//! 4. Both sides floored to multiples of 16 (`vae_scale_factor * 2`), centre crop (no resize).
//! 5. `x / 255 * 2 - 1` in float32, layout `[1, 3, H, W]`.
//!
//! [`read_header`] gives a file's oriented size without decoding it, for checks before decoding.
use std::borrow::Cow;
use std::io::Read;
use std::path::Path;

use image::{DynamicImage, RgbImage};
use ndarray::Array4;
use serde::{Deserialize, Serialize};

use crate::error::{KleinError, Result};
use crate::limits::MAX_DECODE_FILE_BYTES;

mod container;
mod decode;
mod fill;
mod header;
mod jpeg;
mod libjpeg;
mod orientation;
mod png;
mod resize;
mod webp;

pub use fill::{fill_plan, fill_reference, FillPlan};
pub use header::{ImageFormat, ImageHeader};

/// The limits of `Flux2ImageProcessor.check_image_input` and the resize threshold of the pipeline.
/// Mirrors the manifest's `references` section (its other keys are ignored here).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ReferenceLimits {
    /// Both sides must be at least this many pixels.
    pub min_side: u32,
    /// `max(w/h, h/w)` must not exceed this.
    pub max_aspect_ratio: f64,
    /// Images with more pixels are downscaled (Lanczos) to about this many.
    pub max_area: u64,
}

impl Default for ReferenceLimits {
    /// diffusers 0.42.1: `check_image_input(max_aspect_ratio=8, min_side_length=64)` and the
    /// `1024 * 1024` of `Flux2KleinPipeline.__call__`.
    fn default() -> Self {
        Self {
            min_side: 64,
            max_aspect_ratio: 8.0,
            max_area: 1024 * 1024,
        }
    }
}

/// A preprocessed reference image, ready for the VAE encoder.
#[derive(Debug, Clone, PartialEq)]
pub struct ReferenceImage {
    /// Width after resizing and cropping (a multiple of `pixel_multiple`).
    pub width: u32,
    /// Height after resizing and cropping (a multiple of `pixel_multiple`).
    pub height: u32,
    /// `[1, 3, height, width]`, RGB in [-1, 1].
    pub pixels: Array4<f32>,
    /// FLUX.3's single reference ([`fill_reference`]): the image's `[left, top, right, bottom]`
    /// box inside its padded canvas, which the output is cropped back to when no size is given.
    pub crop_box: Option<[u32; 4]>,
}

pub(crate) fn image_error(label: &Path) -> impl Fn(String) -> KleinError + '_ {
    move |reason| KleinError::Image {
        path: label.to_path_buf(),
        reason,
    }
}

/// Reads a whole reference file, refusing one larger than [`MAX_DECODE_FILE_BYTES`]: unread where
/// its size is known, else (a pipe, a device) once that much has been read.
pub(crate) fn read_file(path: &Path) -> Result<Vec<u8>> {
    let io_error = |action: &'static str| {
        move |source: std::io::Error| KleinError::Io {
            path: path.to_path_buf(),
            action,
            source,
        }
    };
    let file = std::fs::File::open(path).map_err(io_error("open image file"))?;
    let metadata = file
        .metadata()
        .map_err(io_error("read image file metadata"))?;
    if metadata.is_dir() {
        return Err(image_error(path)(
            "this is a directory: give an image file (PNG, JPEG or WebP)".to_string(),
        ));
    }
    let size = metadata.len();
    let too_large = |size: String| {
        image_error(path)(format!(
            "the file ({size} bytes) is larger than this runtime decodes (at most {} MiB); \
             downscale it first",
            MAX_DECODE_FILE_BYTES / (1024 * 1024)
        ))
    };
    if size > MAX_DECODE_FILE_BYTES {
        return Err(too_large(size.to_string()));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
    file.take(MAX_DECODE_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(io_error("read image file"))?;
    if bytes.len() as u64 > MAX_DECODE_FILE_BYTES {
        return Err(too_large(format!("more than {MAX_DECODE_FILE_BYTES}")));
    }
    Ok(bytes)
}

/// A reference file's format and size after EXIF orientation (the size `load_image` gives), read
/// from its header and metadata without decoding pixels; refused, before any pixel allocation,
/// when over [`crate::limits::MAX_DECODE_SIDE`] or [`crate::limits::MAX_DECODE_BYTES`], or when
/// the format is not one klein decodes. A file it accepts may still fail to decode (corrupt data).
pub fn read_header(path: &Path) -> Result<ImageHeader> {
    read_header_bytes(&read_file(path)?, path)
}

/// [`read_header`] of a file already in memory; `label` names it in errors.
pub fn read_header_bytes(bytes: &[u8], label: &Path) -> Result<ImageHeader> {
    let (_, header) = decode::header(bytes).map_err(image_error(label))?;
    Ok(header)
}

/// The RGB8 image `diffusers.utils.load_image(path)` gives, bit for bit: decoded as Pillow decodes
/// it, EXIF orientation applied, converted to RGB (step 1 of the module doc), before any resize or
/// crop.
pub fn decode_image(path: &Path) -> Result<RgbImage> {
    decode_image_bytes(&read_file(path)?, path)
}

/// [`decode_image`] of a file already in memory; `label` names it in errors.
pub fn decode_image_bytes(bytes: &[u8], label: &Path) -> Result<RgbImage> {
    decode::decode(bytes).map_err(image_error(label))
}

/// Reads a PNG, JPEG or WebP file as `load_image` does ([`decode_image`]) and preprocesses it
/// ([`preprocess_reference`]). `pixel_multiple` is the manifest's `latents.pixel_multiple` (16).
pub fn load_reference(
    path: &Path,
    limits: &ReferenceLimits,
    pixel_multiple: u32,
) -> Result<ReferenceImage> {
    let image = decode_image(path)?;
    preprocess_rgb(&image, limits, pixel_multiple, path)
}

/// Decodes the bytes of a PNG, JPEG or WebP file and preprocesses it as [`load_reference`] does
/// (for images that are already in memory). `label` names the image in errors.
pub fn decode_reference_bytes(
    bytes: &[u8],
    limits: &ReferenceLimits,
    pixel_multiple: u32,
    label: &Path,
) -> Result<ReferenceImage> {
    let image = decode_image_bytes(bytes, label)?;
    preprocess_rgb(&image, limits, pixel_multiple, label)
}

/// Preprocesses an already decoded image as the pipeline does (steps 1-5 of the module doc, EXIF
/// orientation excepted: apply it before, as [`load_reference`] does). `label` names the image in
/// errors (its path, or any name the caller gives it).
pub fn preprocess_reference(
    image: &DynamicImage,
    limits: &ReferenceLimits,
    pixel_multiple: u32,
    label: &Path,
) -> Result<ReferenceImage> {
    let rgb = to_rgb8_like_pillow(image).map_err(image_error(label))?;
    preprocess_rgb(&rgb, limits, pixel_multiple, label)
}

/// The size a `width` x `height` image (after EXIF orientation, as [`read_header`] gives it) has
/// once preprocessed (steps 2-4 of the module doc), without its pixels: what the token budget is
/// checked on before any reference is decoded.
pub fn processed_size(
    width: u32,
    height: u32,
    limits: &ReferenceLimits,
    pixel_multiple: u32,
    label: &Path,
) -> Result<(u32, u32)> {
    let fail = image_error(label);
    if pixel_multiple == 0 {
        return Err(fail("the pixel multiple must be at least 1".to_string()));
    }
    check_image_input(width, height, limits).map_err(&fail)?;
    let (w, h) = if u64::from(width) * u64::from(height) > limits.max_area {
        target_area_size(width, height, limits.max_area)
    } else {
        (width, height)
    };
    let (crop_w, crop_h) = (
        w / pixel_multiple * pixel_multiple,
        h / pixel_multiple * pixel_multiple,
    );
    if crop_w == 0 || crop_h == 0 {
        return Err(fail(format!(
            "{width}x{height} preprocessed is {w}x{h}, smaller than {pixel_multiple} px on a side"
        )));
    }
    Ok((crop_w, crop_h))
}

/// The source image of `Flux2KleinInpaintPipeline` (step 2 of its `__call__`), which is resized,
/// not cropped: above `max_area` pixels, Pillow's LANCZOS to `(int(w*s), int(h*s))` with
/// `s = sqrt(max_area / (w*h))`; then LANCZOS again to both sides floored to `pixel_multiple`
/// (Pillow returns a copy when the size is unchanged, as `resize::resize_lanczos` does); then
/// `x / 255 * 2 - 1`. diffusers checks no minimum side or aspect ratio here; klein refuses only
/// what floors to nothing.
pub fn preprocess_source(
    rgb: &RgbImage,
    max_area: u64,
    pixel_multiple: u32,
    label: &Path,
) -> Result<ReferenceImage> {
    let (width, height) = rgb.dimensions();
    let rgb = if u64::from(width) * u64::from(height) > max_area {
        let (w, h) = target_area_size(width, height, max_area);
        Cow::Owned(resize::resize_lanczos(rgb, w.max(1), h.max(1)))
    } else {
        Cow::Borrowed(rgb)
    };
    let (out_w, out_h) = source_size(width, height, max_area, pixel_multiple, label)?;
    let rgb = resize::resize_lanczos(&rgb, out_w, out_h);
    Ok(ReferenceImage {
        width: out_w,
        height: out_h,
        pixels: to_pixels(&rgb, 0, 0, out_w, out_h),
        crop_box: None,
    })
}

/// An RGB image already at its processed size as the VAE encoder takes it (`x / 255 * 2 - 1`).
pub(crate) fn as_reference(rgb: &RgbImage) -> ReferenceImage {
    let (width, height) = rgb.dimensions();
    ReferenceImage {
        width,
        height,
        pixels: to_pixels(rgb, 0, 0, width, height),
        crop_box: None,
    }
}

/// `Image.resize((width, height), LANCZOS)` of Pillow on an RGB8 image, bit for bit.
pub(crate) fn resize_like_pillow(rgb: &RgbImage, width: u32, height: u32) -> RgbImage {
    resize::resize_lanczos(rgb, width, height)
}

/// `Image.resize((width, height), box=bounds)` of Pillow on an RGB8 image (its default filter,
/// BICUBIC), bit for bit: `bounds` (left, top, right, bottom) is the span of `rgb` resampled,
/// possibly of zero width or height.
pub(crate) fn resize_box_like_pillow(
    rgb: &RgbImage,
    width: u32,
    height: u32,
    bounds: [u32; 4],
) -> RgbImage {
    resize::resize_box(rgb, resize::Filter::Bicubic, width, height, bounds)
}

/// The size [`preprocess_source`] gives a `width` x `height` source: above `max_area` pixels
/// scaled down to it, then both sides floored to `pixel_multiple`. Refuses a side that floors to
/// nothing.
pub(crate) fn source_size(
    width: u32,
    height: u32,
    max_area: u64,
    pixel_multiple: u32,
    label: &Path,
) -> Result<(u32, u32)> {
    let (full_w, full_h) = if u64::from(width) * u64::from(height) > max_area {
        let (w, h) = target_area_size(width, height, max_area);
        (w.max(1), h.max(1))
    } else {
        (width, height)
    };
    let multiple = pixel_multiple.max(1);
    let (out_w, out_h) = (full_w / multiple * multiple, full_h / multiple * multiple);
    if out_w == 0 || out_h == 0 {
        return Err(image_error(label)(format!(
            "the source image is {width}x{height}: both sides must be at least {multiple} px"
        )));
    }
    Ok((out_w, out_h))
}

/// The `width` x `height` window at (`left`, `top`) of `rgb` as the VAE takes it:
/// `[H, W, 3]` uint8 -> `[1, 3, H, W]` float32; numpy `x / 255.0` then torch `2 * x - 1`.
fn to_pixels(rgb: &RgbImage, left: u32, top: u32, width: u32, height: u32) -> Array4<f32> {
    Array4::from_shape_fn((1, 3, height as usize, width as usize), |(_, c, y, x)| {
        let value = rgb.get_pixel(left + x as u32, top + y as u32)[c];
        2.0 * (f32::from(value) / 255.0) - 1.0
    })
}

/// Steps 2-5 of the module doc on an RGB8 image.
fn preprocess_rgb(
    rgb: &RgbImage,
    limits: &ReferenceLimits,
    pixel_multiple: u32,
    label: &Path,
) -> Result<ReferenceImage> {
    let fail = image_error(label);
    if pixel_multiple == 0 {
        return Err(fail("the pixel multiple must be at least 1".to_string()));
    }
    let (width, height) = rgb.dimensions();
    check_image_input(width, height, limits).map_err(&fail)?;

    let rgb = if u64::from(width) * u64::from(height) > limits.max_area {
        let (target_w, target_h) = target_area_size(width, height, limits.max_area);
        if target_w < pixel_multiple || target_h < pixel_multiple {
            return Err(fail(format!(
                "{width}x{height} resized to max_area {} gives {target_w}x{target_h}, smaller than \
                 {pixel_multiple} px on a side; raise max_area",
                limits.max_area
            )));
        }
        Cow::Owned(resize::resize_lanczos(rgb, target_w, target_h))
    } else {
        Cow::Borrowed(rgb)
    };
    let (full_w, full_h) = rgb.dimensions();
    let crop_w = full_w / pixel_multiple * pixel_multiple;
    let crop_h = full_h / pixel_multiple * pixel_multiple;
    if crop_w == 0 || crop_h == 0 {
        return Err(fail(format!(
            "{full_w}x{full_h} is smaller than {pixel_multiple} px on a side"
        )));
    }
    // `_resize_and_crop` of Flux2ImageProcessor: a centre crop, no resize.
    let left = (full_w - crop_w) / 2;
    let top = (full_h - crop_h) / 2;
    Ok(ReferenceImage {
        width: crop_w,
        height: crop_h,
        pixels: to_pixels(&rgb, left, top, crop_w, crop_h),
        crop_box: None,
    })
}

/// `Image.convert("RGB")` as Pillow does it, for images decoded elsewhere (alpha dropped, grey
/// replicated, 16-bit samples as Pillow's PNG raw modes read them).
fn to_rgb8_like_pillow(image: &DynamicImage) -> std::result::Result<Cow<'_, RgbImage>, String> {
    let (width, height) = (image.width(), image.height());
    let rgb = match image {
        DynamicImage::ImageRgb8(rgb) => return Ok(Cow::Borrowed(rgb)),
        // RGBA/LA: alpha discarded without compositing; L: grey replicated. The image crate's
        // conversions do exactly this.
        DynamicImage::ImageRgba8(_)
        | DynamicImage::ImageLuma8(_)
        | DynamicImage::ImageLumaA8(_) => image.to_rgb8(),
        // Pillow opens 16-bit RGB(A) and grey+alpha PNGs through 8-bit raw modes that keep the
        // high byte of each sample.
        DynamicImage::ImageRgb16(rgb) => RgbImage::from_fn(width, height, |x, y| {
            let p = rgb.get_pixel(x, y).0;
            image::Rgb([(p[0] >> 8) as u8, (p[1] >> 8) as u8, (p[2] >> 8) as u8])
        }),
        DynamicImage::ImageRgba16(rgba) => RgbImage::from_fn(width, height, |x, y| {
            let p = rgba.get_pixel(x, y).0;
            image::Rgb([(p[0] >> 8) as u8, (p[1] >> 8) as u8, (p[2] >> 8) as u8])
        }),
        DynamicImage::ImageLumaA16(la) => RgbImage::from_fn(width, height, |x, y| {
            let grey = (la.get_pixel(x, y).0[0] >> 8) as u8;
            image::Rgb([grey; 3])
        }),
        // Pillow opens 16-bit grey as mode "I;16", whose conversion to RGB clips at 255.
        DynamicImage::ImageLuma16(luma) => RgbImage::from_fn(width, height, |x, y| {
            let grey = luma.get_pixel(x, y).0[0].min(255) as u8;
            image::Rgb([grey; 3])
        }),
        other => {
            return Err(format!(
                "unsupported pixel format {:?}; use 8- or 16-bit RGB, RGBA or greyscale",
                other.color()
            ))
        }
    };
    Ok(Cow::Owned(rgb))
}

/// `Flux2ImageProcessor.check_image_input`, with its messages.
fn check_image_input(
    width: u32,
    height: u32,
    limits: &ReferenceLimits,
) -> std::result::Result<(), String> {
    if width < limits.min_side || height < limits.min_side {
        return Err(format!(
            "image too small: {width}x{height}. Both dimensions must be at least {}px",
            limits.min_side
        ));
    }
    let (w, h) = (f64::from(width), f64::from(height));
    let aspect_ratio = (w / h).max(h / w);
    if aspect_ratio > limits.max_aspect_ratio {
        return Err(format!(
            "aspect ratio too extreme: {width}x{height} (ratio: {aspect_ratio:.1}:1). Maximum \
             allowed ratio is {}:1",
            limits.max_aspect_ratio
        ));
    }
    Ok(())
}

/// `_resize_to_target_area`'s size: `s = sqrt(target / (w*h))`, `(int(w*s), int(h*s))` in f64.
fn target_area_size(width: u32, height: u32, target_area: u64) -> (u32, u32) {
    let scale = (target_area as f64 / (u64::from(width) * u64::from(height)) as f64).sqrt();
    (
        (f64::from(width) * scale) as u32,
        (f64::from(height) * scale) as u32,
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;
    use crate::limits::MAX_DECODE_SIDE;
    use safetensors::{Dtype, SafeTensors};
    use std::path::PathBuf;

    const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/reference");
    const MULTIPLE: u32 = 16;

    fn fixture(name: &str) -> PathBuf {
        Path::new(DIR).join(name)
    }

    /// Fails with the count of differing values and the first few, expected vs got.
    fn assert_same<T: Copy + std::fmt::Debug>(
        what: &str,
        expected: &[T],
        got: &[T],
        same: impl Fn(T, T) -> bool,
    ) {
        assert_eq!(expected.len(), got.len(), "{what}: length");
        let diffs: Vec<(usize, T, T)> = expected
            .iter()
            .zip(got)
            .enumerate()
            .filter(|(_, (e, g))| !same(**e, **g))
            .map(|(i, (e, g))| (i, *e, *g))
            .collect();
        assert!(
            diffs.is_empty(),
            "{what}: {} of {} values differ; first (index, expected, got): {:?}",
            diffs.len(),
            expected.len(),
            &diffs[..diffs.len().min(8)]
        );
    }

    /// Against diffusers' own preprocessing of the fixture (made by
    /// tests/fixtures/make_reference_fixtures.py with the max_area recorded for it), tolerance 0:
    /// same shape and bit-identical float32 values.
    fn check_fixture(name: &str) {
        let bytes = std::fs::read(fixture("expected.safetensors")).unwrap();
        let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
        let max_area: u64 = header.metadata().as_ref().unwrap()[name].parse().unwrap();
        let tensors = SafeTensors::deserialize(&bytes).unwrap();
        let view = tensors.tensor(name).unwrap();
        assert_eq!(view.dtype(), Dtype::F32);
        let expected: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();

        let limits = ReferenceLimits {
            max_area,
            ..ReferenceLimits::default()
        };
        let got = load_reference(&fixture(name), &limits, MULTIPLE).unwrap();
        assert_eq!(got.pixels.shape(), view.shape(), "{name}: shape");
        assert_eq!(
            [got.height as usize, got.width as usize],
            view.shape()[2..],
            "{name}: size"
        );
        let got: Vec<f32> = got.pixels.iter().copied().collect();
        assert_same(name, &expected, &got, |e, g| e.to_bits() == g.to_bits());
    }

    #[test]
    fn rgba_png_drops_alpha_without_compositing() {
        check_fixture("rgba.png");
    }

    #[test]
    fn jpeg_exif_orientation_6_is_applied() {
        check_fixture("orient6.jpg");
    }

    #[test]
    fn webp_exif_orientation_8_is_applied() {
        check_fixture("orient8.webp");
    }

    #[test]
    fn lossy_webp_matches() {
        check_fixture("lossy.webp");
    }

    #[test]
    fn grayscale_png_is_replicated() {
        check_fixture("gray.png");
    }

    #[test]
    fn palette_png_uses_its_palette_colours() {
        check_fixture("palette.png");
    }

    #[test]
    fn sixteen_bit_pngs_convert_as_pillow() {
        check_fixture("rgb16.png");
        check_fixture("gray16.png");
    }

    #[test]
    fn images_over_max_area_are_resized_with_lanczos_and_cropped() {
        check_fixture("large.png");
        check_fixture("wide.png");
    }

    /// The Lanczos port against Pillow's `Image.resize(..., LANCZOS)` on uint8 RGB, tolerance 0.
    #[test]
    fn lanczos_is_bit_identical_to_pillow() {
        let source = image::open(fixture("large.png")).unwrap().to_rgb8();
        let source = image::imageops::crop_imm(&source, 0, 0, 60, 40).to_image();
        let bytes = std::fs::read(fixture("lanczos.safetensors")).unwrap();
        let tensors = SafeTensors::deserialize(&bytes).unwrap();
        let mut names = tensors.names();
        names.sort();
        assert_eq!(names.len(), 6);
        for name in names {
            let view = tensors.tensor(name).unwrap();
            assert_eq!(view.dtype(), Dtype::U8);
            let (w, h) = name.split_once('x').unwrap();
            let got = resize::resize_lanczos(&source, w.parse().unwrap(), h.parse().unwrap());
            assert_eq!(
                [got.height() as usize, got.width() as usize, 3],
                view.shape(),
                "{name}"
            );
            assert_same(name, view.data(), got.as_raw(), |e, g| e == g);
        }
    }

    /// The size computed from the header is the size preprocessing gives.
    #[test]
    fn processed_size_is_the_preprocessed_size() {
        let limits = ReferenceLimits {
            max_area: 96 * 96,
            ..ReferenceLimits::default()
        };
        for (w, h) in [(150, 110), (64, 64), (100, 70), (200, 90)] {
            let rgb = RgbImage::new(w, h);
            let label = Path::new("x");
            let image = preprocess_rgb(&rgb, &limits, 16, label).unwrap();
            assert_eq!(
                processed_size(w, h, &limits, 16, label).unwrap(),
                (image.width, image.height),
                "{w}x{h}"
            );
        }
    }

    #[test]
    fn target_area_size_truncates_like_python() {
        // int(150 * s), int(110 * s) with s = sqrt(9216 / 16500)
        assert_eq!(target_area_size(150, 110, 96 * 96), (112, 82));
        // 4000x3000 -> 1182x886 with the pipeline's 1024*1024
        assert_eq!(target_area_size(4000, 3000, 1024 * 1024), (1182, 886));
    }

    fn reason(result: Result<ReferenceImage>) -> String {
        match result {
            Err(KleinError::Image { reason, .. }) => reason,
            other => panic!("expected an image error, got {other:?}"),
        }
    }

    #[test]
    fn check_image_input_refuses_small_and_extreme_images() {
        let limits = ReferenceLimits::default();
        let label = Path::new("test");
        let small = DynamicImage::new_rgb8(63, 100);
        let err = reason(preprocess_reference(&small, &limits, MULTIPLE, label));
        assert!(err.contains("too small: 63x100"), "{err}");
        let extreme = DynamicImage::new_rgb8(64 * 8 + 1, 64);
        let err = reason(preprocess_reference(&extreme, &limits, MULTIPLE, label));
        assert!(err.contains("aspect ratio too extreme: 513x64"), "{err}");
        let edge = DynamicImage::new_rgb8(64 * 8, 64);
        let ok = preprocess_reference(&edge, &limits, MULTIPLE, label).unwrap();
        assert_eq!((ok.width, ok.height), (512, 64));
        assert!(ok.pixels.iter().all(|&v| v == -1.0));
    }

    /// A directory of its own for the files one test writes, removed when dropped.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(test: &str) -> Self {
            let dir = std::env::temp_dir().join(format!(
                "klein-reference-test-{}-{test}",
                std::process::id()
            ));
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        fn path(&self, name: &str) -> PathBuf {
            self.0.join(name)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn unreadable_files_are_refused() {
        let limits = ReferenceLimits::default();
        let scratch = Scratch::new("unreadable");
        let missing = load_reference(&scratch.path("missing.png"), &limits, MULTIPLE);
        assert!(matches!(missing, Err(KleinError::Io { .. })), "{missing:?}");

        let empty = scratch.path("empty.png");
        std::fs::write(&empty, b"").unwrap();
        assert!(reason(load_reference(&empty, &limits, MULTIPLE)).contains("empty"));

        let text = scratch.path("text.png");
        std::fs::write(&text, b"this is not an image at all").unwrap();
        let err = reason(load_reference(&text, &limits, MULTIPLE));
        assert!(err.contains("not a PNG, JPEG or WebP"), "{err}");

        let truncated = scratch.path("truncated.png");
        let png = std::fs::read(fixture("rgba.png")).unwrap();
        std::fs::write(&truncated, &png[..png.len() / 2]).unwrap();
        let err = reason(load_reference(&truncated, &limits, MULTIPLE));
        assert!(err.contains("cannot decode"), "{err}");
    }

    /// A PNG whose header claims `width x height` RGBA 16-bit, with an empty IDAT chunk.
    fn png_header_only(width: u32, height: u32) -> Vec<u8> {
        let mut ihdr = b"IHDR".to_vec();
        ihdr.extend(width.to_be_bytes());
        ihdr.extend(height.to_be_bytes());
        ihdr.extend([16, 6, 0, 0, 0]);
        let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
        png.extend(13u32.to_be_bytes());
        png.extend(&ihdr);
        png.extend(crc32fast::hash(&ihdr).to_be_bytes());
        for empty in [b"IDAT", b"IEND"] {
            png.extend(0u32.to_be_bytes());
            png.extend(empty);
            png.extend(crc32fast::hash(empty).to_be_bytes());
        }
        png
    }

    #[test]
    fn absurdly_large_images_are_refused_before_decoding() {
        let limits = ReferenceLimits::default();
        let scratch = Scratch::new("large");
        for (name, width, height) in [
            ("wide.png", MAX_DECODE_SIDE + 1, 64),
            // within the side limit, but 16384 * 4096 * 8 bytes = 512 MiB
            ("heavy.png", MAX_DECODE_SIDE, 4097),
        ] {
            let path = scratch.path(name);
            std::fs::write(&path, png_header_only(width, height)).unwrap();
            let err = reason(load_reference(&path, &limits, MULTIPLE));
            assert!(
                err.contains("larger than this runtime decodes"),
                "{name}: {err}"
            );
            let header = read_header(&path);
            assert!(
                matches!(&header, Err(KleinError::Image { reason, .. })
                    if reason.contains("larger than this runtime decodes")),
                "{name}: {header:?}"
            );
        }
    }

    #[test]
    fn limits_deserialise_from_the_manifest_section() {
        let json = r#"{ "min_side": 64, "max_aspect_ratio": 8, "max_area": 1048576,
                        "time_offset_scale": 10 }"#;
        let limits: ReferenceLimits = serde_json::from_str(json).unwrap();
        assert_eq!(limits, ReferenceLimits::default());
    }
}
