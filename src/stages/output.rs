//! Stage 7 output: decoder floats to uint8 RGB, and PNG bytes with text metadata.

use ndarray::ArrayView4;

use crate::error::{KleinError, Result};

/// An 8-bit RGB image, row-major `[height, width, 3]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: u32,
    pub height: u32,
    pub pixels: Vec<u8>,
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
