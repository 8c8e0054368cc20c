//! Stage 7 output: decoder floats to uint8 RGB, and the bytes of a PNG, JPEG or WebP file with the
//! generation settings as metadata.
use std::path::Path;

use image::codecs::jpeg::JpegEncoder;
use image::codecs::webp::WebPEncoder;
use image::ExtendedColorType;

use ndarray::ArrayView4;

use crate::error::{KleinError, Result};

/// An 8-bit RGB image, row-major `[height, width, 3]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: u32,
    pub height: u32,
    pub pixels: Vec<u8>,
}

impl RgbImage {
    /// The `[left, top, right, bottom]` box of this image (inside it).
    pub fn crop(&self, [left, top, right, bottom]: [u32; 4]) -> RgbImage {
        let (width, height) = (right - left, bottom - top);
        let mut pixels = Vec::with_capacity(width as usize * height as usize * 3);
        for y in top..bottom {
            let row = (y * self.width + left) as usize * 3;
            pixels.extend_from_slice(&self.pixels[row..row + width as usize * 3]);
        }
        RgbImage {
            width,
            height,
            pixels,
        }
    }
}

/// Decoder output `[B, 3, H, W]` (about [-1, 1]) to uint8 images, as diffusers' postprocess:
/// `(y * 0.5 + 0.5).clamp(0, 1)`, then numpy's `(x * 255).round()` (round half to even).
pub fn to_rgb_images(decoded: ArrayView4<f32>) -> Vec<RgbImage> {
    let (batch, _, height, width) = decoded.dim();
    (0..batch)
        .map(|b| {
            let mut pixels = Vec::with_capacity(height * width * 3);
            for y in 0..height {
                for x in 0..width {
                    for c in 0..3 {
                        let v = (decoded[[b, c, y, x]] * 0.5 + 0.5).clamp(0.0, 1.0);
                        pixels.push((v * 255.0).round_ties_even() as u8);
                    }
                }
            }
            RgbImage {
                width: width as u32,
                height: height as u32,
                pixels,
            }
        })
        .collect()
}

/// The file formats an output can be written in, chosen by the file's extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    /// PNG, with the generation settings as UTF-8 text chunks (iTXt).
    Png,
    /// Baseline JPEG at `quality` (1-100), with the settings as JSON in a comment (COM) segment.
    Jpeg { quality: u8 },
    /// Lossless WebP (the `image` crate writes no lossy WebP), without the settings.
    WebP,
}

/// Extensions [`ImageFormat::from_path`] knows, for messages.
pub const OUTPUT_EXTENSIONS: &str = ".png, .jpg, .jpeg or .webp";

impl ImageFormat {
    /// The format `path`'s extension names (case-insensitive; none: PNG); `jpeg_quality` is used
    /// for JPEG.
    pub fn from_path(path: &Path, jpeg_quality: u8) -> Result<ImageFormat> {
        let extension = path
            .extension()
            .map(|e| e.to_string_lossy().to_ascii_lowercase());
        match extension.as_deref() {
            None | Some("png") => Ok(ImageFormat::Png),
            Some("jpg" | "jpeg") => Ok(ImageFormat::Jpeg {
                quality: jpeg_quality,
            }),
            Some("webp") => Ok(ImageFormat::WebP),
            Some(other) => Err(KleinError::request(format!(
                "output {}: klein writes {OUTPUT_EXTENSIONS} files, not .{other}",
                path.display()
            ))),
        }
    }
}

/// Encodes `image` in `format`, with `text` (key, value pairs) where the format holds it.
pub fn encode_image(
    image: &RgbImage,
    format: ImageFormat,
    text: &[(String, String)],
) -> Result<Vec<u8>> {
    match format {
        ImageFormat::Png => encode_png(image, text),
        ImageFormat::Jpeg { quality } => encode_jpeg(image, quality, text),
        ImageFormat::WebP => encode_webp(image),
    }
}

fn encode_error(format: &'static str, e: impl std::fmt::Display) -> KleinError {
    KleinError::Inference {
        stage: format,
        message: e.to_string(),
    }
}

/// Baseline JPEG; `text` as a JSON object in a COM segment right after SOI.
fn encode_jpeg(image: &RgbImage, quality: u8, text: &[(String, String)]) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    JpegEncoder::new_with_quality(&mut bytes, quality.clamp(1, 100))
        .encode(
            &image.pixels,
            image.width,
            image.height,
            ExtendedColorType::Rgb8,
        )
        .map_err(|e| encode_error("jpeg encode", e))?;
    let object: serde_json::Map<String, serde_json::Value> = text
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
        .collect();
    let comment = serde_json::to_vec(&object).map_err(|e| encode_error("jpeg encode", e))?;
    // A segment's length (2 bytes) counts itself: at most 65533 bytes of comment.
    if let Ok(length) = u16::try_from(comment.len() + 2) {
        if bytes.starts_with(&[0xFF, 0xD8]) {
            let mut segment = vec![0xFF, 0xFE];
            segment.extend_from_slice(&length.to_be_bytes());
            segment.extend_from_slice(&comment);
            bytes.splice(2..2, segment);
        }
    }
    Ok(bytes)
}

/// Lossless WebP.
fn encode_webp(image: &RgbImage) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    WebPEncoder::new_lossless(&mut bytes)
        .encode(
            &image.pixels,
            image.width,
            image.height,
            ExtendedColorType::Rgb8,
        )
        .map_err(|e| encode_error("webp encode", e))?;
    Ok(bytes)
}

/// Encodes `image` as PNG with UTF-8 text chunks (iTXt), in memory.
pub fn encode_png(image: &RgbImage, text: &[(String, String)]) -> Result<Vec<u8>> {
    let mut bytes = Vec::new();
    let fail = |e: png::EncodingError| KleinError::Inference {
        stage: "png encode",
        message: e.to_string(),
    };
    {
        let mut encoder = png::Encoder::new(&mut bytes, image.width, image.height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        for (key, value) in text {
            encoder
                .add_itxt_chunk(key.clone(), value.clone())
                .map_err(fail)?;
        }
        let mut writer = encoder.write_header().map_err(fail)?;
        writer.write_image_data(&image.pixels).map_err(fail)?;
        writer.finish().map_err(fail)?;
    }
    Ok(bytes)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;
    use ndarray::Array4;

    #[test]
    fn maps_decoder_range_like_diffusers() {
        // [-1, 1] -> [0, 255], clamped, round half to even (numpy): 0.5*255 = 127.5 -> 128 (even).
        let decoded = Array4::from_shape_vec(
            (1, 3, 1, 2),
            vec![-2.0, 1.5, 0.0, 1.0, -1.0, 0.003_921_568_6],
        )
        .unwrap();
        let images = to_rgb_images(decoded.view());
        assert_eq!(images[0].pixels, vec![0, 128, 0, 255, 255, 128]);
    }

    #[test]
    fn formats_follow_the_extension() {
        let format = |p: &str| ImageFormat::from_path(Path::new(p), 90);
        assert_eq!(format("a.PNG").unwrap(), ImageFormat::Png);
        assert_eq!(format("a").unwrap(), ImageFormat::Png);
        assert_eq!(format("a.jpeg").unwrap(), ImageFormat::Jpeg { quality: 90 });
        assert_eq!(format("a.webp").unwrap(), ImageFormat::WebP);
        let error = format("a.gif").unwrap_err().to_string();
        assert!(
            error.contains("not .gif") && error.contains(OUTPUT_EXTENSIONS),
            "{error}"
        );
    }

    /// Each format decodes back to the image (exactly for PNG and WebP, closely for JPEG) and the
    /// JPEG's comment holds the settings.
    #[test]
    fn every_format_decodes_back() {
        let image = RgbImage {
            width: 16,
            height: 8,
            // A smooth gradient: JPEG's chroma subsampling keeps it within a few levels.
            pixels: (0..16 * 8)
                .flat_map(|i| [(i % 16 * 16) as u8, (i / 16 * 32) as u8, 128])
                .collect(),
        };
        let text = vec![("seed".to_string(), "7".to_string())];
        for format in [
            ImageFormat::Png,
            ImageFormat::WebP,
            ImageFormat::Jpeg { quality: 100 },
        ] {
            let bytes = encode_image(&image, format, &text).unwrap();
            let decoded = image::load_from_memory(&bytes).unwrap().to_rgb8();
            let worst = decoded
                .as_raw()
                .iter()
                .zip(&image.pixels)
                .map(|(a, b)| a.abs_diff(*b))
                .max()
                .unwrap();
            // Lossless formats exactly; JPEG at quality 100 within 8 levels on this smooth gradient.
            let allowed = if format == ImageFormat::Png || format == ImageFormat::WebP {
                0
            } else {
                8
            };
            assert!(worst <= allowed, "{format:?}: max difference {worst}");
        }
        let jpeg = encode_image(&image, ImageFormat::Jpeg { quality: 90 }, &text).unwrap();
        assert_eq!(&jpeg[..4], &[0xFF, 0xD8, 0xFF, 0xFE]);
        let length = usize::from(u16::from_be_bytes([jpeg[4], jpeg[5]]));
        assert_eq!(&jpeg[6..4 + length], br#"{"seed":"7"}"#);
    }

    #[test]
    fn png_round_trip_keeps_pixels_and_text() {
        let image = RgbImage {
            width: 2,
            height: 1,
            pixels: vec![1, 2, 3, 250, 251, 252],
        };
        let text = vec![("prompt".to_string(), "un café ☕".to_string())];
        let bytes = encode_png(&image, &text).unwrap();
        let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
        let mut reader = decoder.read_info().unwrap();
        let itxt = &reader.info().utf8_text;
        assert_eq!(itxt[0].keyword, "prompt");
        assert_eq!(itxt[0].get_text().unwrap(), "un café ☕");
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        reader.next_frame(&mut buf).unwrap();
        assert_eq!(buf, image.pixels);
    }
}
