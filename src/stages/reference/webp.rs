//! WebP to RGB as `load_image` gives it. Pillow decodes with libwebp's `WebPAnimDecoder` into
//! non-premultiplied RGBA (the first frame of an animation, on a transparent black canvas), then
//! `convert("RGB")` drops alpha. image-webp decodes VP8 (whose reconstruction the format fixes to
//! the bit), libwebp's fancy chroma upsampling and YUV to RGB conversion, and lossless VP8L; the
//! corpus of tests/it/decode.rs checks it against Pillow.
use std::io::Cursor;

use image::RgbImage;

use super::container;
use crate::limits::MAX_DECODE_BYTES;

/// Decodes a WebP file's bytes to RGB8.
pub(super) fn decode(bytes: &[u8]) -> Result<RgbImage, String> {
    let fail = |e: image_webp::DecodingError| {
        format!("cannot decode ({e}); the file may be corrupt or truncated")
    };
    let riff = container::webp_riff(bytes)?;
    let mut decoder = image_webp::WebPDecoder::new(Cursor::new(riff)).map_err(fail)?;
    decoder.set_memory_limit(usize::try_from(MAX_DECODE_BYTES).unwrap_or(usize::MAX));
    let (width, height) = decoder.dimensions();
    let size = decoder
        .output_buffer_size()
        .ok_or("cannot decode (the WebP image is too large to hold in memory)")?;
    let mut pixels = vec![0u8; size];
    decoder.read_image(&mut pixels).map_err(fail)?;
    let rgb = if decoder.has_alpha() {
        // [H, W, 4] RGBA -> [H, W, 3]: alpha dropped, not composited
        pixels
            .chunks_exact(4)
            .flat_map(|p| [p[0], p[1], p[2]])
            .collect()
    } else {
        pixels
    };
    RgbImage::from_raw(width, height, rgb)
        .ok_or_else(|| "cannot decode (the WebP data is shorter than its header)".to_string())
}
