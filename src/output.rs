//! Stage 7 output: decoder floats to uint8 RGB, and PNG files with text metadata written atomically.
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

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

/// Writes `bytes` to `path` atomically: a hidden temporary file in the same directory, synced, then
/// renamed over `path`. On any error the temporary file is removed and `path` is untouched.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_path(path);
    let io = |action, source| KleinError::Io {
        path: path.to_path_buf(),
        action,
        source,
    };
    let result = (|| {
        let mut file = std::fs::File::create(&tmp).map_err(|e| io("create", e))?;
        file.write_all(bytes).map_err(|e| io("write", e))?;
        file.sync_all().map_err(|e| io("sync", e))?;
        std::fs::rename(&tmp, path).map_err(|e| io("rename into place", e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// `.NAME.klein-tmp-PID-N`: unique per process and per call, so that threads writing the same
/// path at once (two pipelines stamping one bundle) do not share a temporary file.
fn temp_path(path: &Path) -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.klein-tmp-{}-{n}", std::process::id()))
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

    #[test]
    fn failed_write_leaves_no_file() {
        let dir = std::env::temp_dir().join(format!("klein-out-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("no-such-dir").join("x.png");
        assert!(write_atomic(&missing, b"data").is_err());
        let ok = dir.join("x.png");
        write_atomic(&ok, b"data").unwrap();
        assert_eq!(std::fs::read(&ok).unwrap(), b"data");
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .collect();
        assert_eq!(leftovers.len(), 1, "only the output file remains");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
