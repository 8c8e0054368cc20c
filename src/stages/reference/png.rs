//! PNG to RGB as `load_image` gives it: the raw samples of the first image (the IDAT image, frame 0
//! of an APNG), deinterlaced, in the mode and raw mode `PngImagePlugin._MODES` gives each bit depth
//! and colour type, then Pillow's `convert("RGB")`. No gamma, sBIT or colour profile is applied
//! (Pillow applies none).
use std::io::Cursor;

use image::RgbImage;

use crate::limits::MAX_DECODE_BYTES;

/// Decodes a PNG file's bytes to RGB8.
pub(super) fn decode(bytes: &[u8]) -> Result<RgbImage, String> {
    let fail = |e: ::png::DecodingError| {
        format!("cannot decode ({e}); the file may be corrupt or truncated")
    };
    // Pillow checks the CRCs of the chunks before IDAT (container.rs does too), not of IDAT or
    // after it; zlib checks the image data's Adler-32 (Pillow: "broken data stream" when it is
    // wrong, or when a byte of the data is changed and the chunk's CRC made to match).
    let mut options = ::png::DecodeOptions::default();
    options.set_ignore_crc(true);
    options.set_ignore_adler32(false);
    let mut decoder = ::png::Decoder::new_with_options(Cursor::new(bytes), options);
    decoder.set_limits(::png::Limits {
        bytes: usize::try_from(MAX_DECODE_BYTES).unwrap_or(usize::MAX),
    });
    decoder.set_transformations(::png::Transformations::IDENTITY);
    decoder.set_ignore_text_chunk(true);
    let mut reader = decoder.read_info().map_err(fail)?;
    let size = reader
        .output_buffer_size()
        .ok_or("cannot decode (the PNG is too large to hold in memory)")?;
    let mut raw = vec![0u8; size];
    let frame = reader.next_frame(&mut raw).map_err(fail)?;
    let info = reader.info();
    let (width, height) = (frame.width, frame.height);
    if (width, height) != (info.width, info.height) {
        return Err("cannot decode (an APNG whose first frame is not the whole image)".to_string());
    }
    let depth = frame.bit_depth as u8;
    let palette = info.palette.as_deref().unwrap_or(&[]);
    let rows = raw.chunks_exact(frame.line_size).take(height as usize);
    let mut rgb = Vec::with_capacity(width as usize * height as usize * 3);
    for row in rows {
        convert_row(
            row,
            width as usize,
            depth,
            frame.color_type,
            palette,
            &mut rgb,
        );
    }
    RgbImage::from_raw(width, height, rgb)
        .ok_or_else(|| "cannot decode (the PNG data is shorter than its header)".to_string())
}

/// Sample `i` of a row packed at `depth` < 8 bits, most significant bits first.
fn packed(row: &[u8], depth: u8, i: usize) -> u8 {
    let per_byte = 8 / usize::from(depth);
    let shift = 8 - depth * (1 + (i % per_byte) as u8);
    (row[i / per_byte] >> shift) & ((1u16 << depth) - 1) as u8
}

/// One raw row to RGB, as Pillow's unpacker for the raw mode and `convert("RGB")` do it.
fn convert_row(
    row: &[u8],
    width: usize,
    depth: u8,
    colour: ::png::ColorType,
    palette: &[u8],
    out: &mut Vec<u8>,
) {
    use ::png::ColorType;
    let grey = |out: &mut Vec<u8>, v: u8| out.extend([v, v, v]);
    match (colour, depth) {
        // "1", "L;2", "L;4": bits scaled to 0..255 (x255, x85, x17); "L"
        (ColorType::Grayscale, 1 | 2 | 4) => {
            let scale = 255 / ((1u16 << depth) - 1) as u8;
            (0..width).for_each(|i| grey(out, packed(row, depth, i) * scale));
        }
        (ColorType::Grayscale, 8) => row[..width].iter().for_each(|&v| grey(out, v)),
        // "I;16B" -> RGB: the 16-bit value clipped at 255
        (ColorType::Grayscale, _) => row.chunks_exact(2).take(width).for_each(|s| {
            grey(out, u16::from_be_bytes([s[0], s[1]]).min(255) as u8);
        }),
        // "P;n", "P": palette colours; an index past the PLTE entries is black
        (ColorType::Indexed, _) => (0..width).for_each(|i| {
            let index = if depth == 8 {
                row[i]
            } else {
                packed(row, depth, i)
            };
            let at = usize::from(index) * 3;
            out.extend(palette.get(at..at + 3).unwrap_or(&[0, 0, 0]));
        }),
        // "LA", "LA;16B" (high byte): grey replicated, alpha dropped
        (ColorType::GrayscaleAlpha, _) => {
            let step = 2 * usize::from(depth / 8);
            row.chunks_exact(step)
                .take(width)
                .for_each(|s| grey(out, s[0]));
        }
        // "RGB", "RGBA", "RGB;16B", "RGBA;16B": the high byte of each sample, alpha dropped
        (ColorType::Rgb | ColorType::Rgba, _) => {
            let channels = if colour == ColorType::Rgb { 3 } else { 4 };
            let bytes = usize::from(depth / 8);
            row.chunks_exact(channels * bytes)
                .take(width)
                .for_each(|p| out.extend([p[0], p[bytes], p[2 * bytes]]));
        }
    }
}
