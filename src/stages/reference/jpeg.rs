//! JPEG to RGB as `load_image` gives it: libjpeg-turbo's samples ([`super::libjpeg`]), then
//! Pillow's `convert("RGB")` of the mode `JpegImagePlugin` opens (L for one component, RGB for
//! three, CMYK for four, read through the inverted raw mode "CMYK;I" that Pillow assumes for every
//! CMYK JPEG).
use image::RgbImage;

use super::header::too_large;
use super::libjpeg::{self, Bounds, Failure};
use crate::limits::{MAX_DECODE_BYTES, MAX_DECODE_SIDE};

/// Decodes a JPEG file's bytes to RGB8.
pub(super) fn decode(bytes: &[u8]) -> Result<RgbImage, String> {
    let bounds = Bounds {
        max_side: MAX_DECODE_SIDE,
        max_bytes: MAX_DECODE_BYTES,
    };
    let samples = libjpeg::decompress(bytes, &bounds).map_err(describe)?;
    let (width, height) = (samples.width, samples.height);
    let rgb: Vec<u8> = match samples.components {
        // L -> RGB: the grey value in every channel
        1 => samples.data.iter().flat_map(|&l| [l, l, l]).collect(),
        3 => samples.data,
        // [H, W, 4] CMYK -> [H, W, 3] RGB
        _ => samples
            .data
            .chunks_exact(4)
            .flat_map(|p| cmyk_inverted_to_rgb([p[0], p[1], p[2], p[3]]))
            .collect(),
    };
    RgbImage::from_raw(width, height, rgb)
        .ok_or_else(|| "cannot decode (libjpeg returned a short image)".to_string())
}

/// Pillow's `MULDIV255` (`ImagingUtils.h`): `a * b / 255` rounded, in integers.
fn muldiv255(a: u32, b: u32) -> u32 {
    let t = a * b + 128;
    ((t >> 8) + t) >> 8
}

/// libjpeg's CMYK samples, unpacked with Pillow's "CMYK;I" (each inverted: `255 - v`), then
/// `cmyk2rgb` of `Convert.c`: `nk = 255 - k`, `channel = clip(nk - MULDIV255(c, nk))`.
fn cmyk_inverted_to_rgb(stored: [u8; 4]) -> [u8; 3] {
    let [c, m, y, k] = stored.map(|v| u32::from(255 - v));
    let nk = 255 - k;
    // nk - c*nk/255 is in 0..=255: CLIP8 never clips here.
    [c, m, y].map(|v| (nk - muldiv255(v, nk)) as u8)
}

/// A refusal for libjpeg's failure, worded for users.
fn describe(failure: Failure) -> String {
    match failure {
        Failure::Truncated => "cannot decode (the JPEG data ends early: the file is truncated; \
                               Pillow refuses it too)"
            .to_string(),
        Failure::Components(n) => {
            format!("cannot decode a JPEG with {n} colour components (Pillow opens 1, 3 or 4)")
        }
        Failure::Empty => "cannot decode (a JPEG with no pixels)".to_string(),
        Failure::TooLarge { width, height } => too_large(width, height),
        Failure::Libjpeg { code, .. } if code == mozjpeg_sys::JERR_CANT_SUSPEND => format!(
            "cannot decode this arithmetic-coded JPEG as Pillow does: its data runs across one of \
             the {} KiB blocks Pillow feeds libjpeg, whose arithmetic decoder cannot wait for the \
             next, so Pillow fails on it (\"broken data stream\"); re-encode it with Huffman \
             coding (the default of every encoder)",
            libjpeg::PILLOW_BLOCK / 1024
        ),
        Failure::Libjpeg { code, .. } if code == mozjpeg_sys::JERR_NO_BACKING_STORE => {
            format!(
                "the image needs more than {} MiB of decoder memory (a large progressive JPEG); \
                 downscale it first",
                MAX_DECODE_BYTES / (1024 * 1024)
            )
        }
        Failure::Libjpeg {
            template,
            ints,
            text,
            ..
        } => format!(
            "cannot decode (libjpeg: {}); the file may be corrupt or truncated",
            printf(&template, &ints, &text)
        ),
    }
}

/// libjpeg's `format_message`: its message templates use `%d %u %x %c %s` with flags and widths,
/// formatted with the 8 int parameters in order, or with the string parameter.
fn printf(template: &str, ints: &[i32; 8], text: &str) -> String {
    let mut out = String::new();
    let mut chars = template.chars().peekable();
    let mut next_int = ints.iter();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut spec = String::new();
        while let Some(&d) = chars.peek() {
            if d.is_ascii_digit() || d == '-' || d == 'l' {
                spec.push(d);
                chars.next();
            } else {
                break;
            }
        }
        let zero = spec.starts_with('0');
        let width: usize = spec
            .trim_start_matches(['0', '-'])
            .trim_end_matches('l')
            .parse()
            .unwrap_or(0);
        let value = match chars.next() {
            Some('%') => "%".to_string(),
            Some('s') => text.to_string(),
            Some(conversion) => {
                let v = next_int.next().copied().unwrap_or(0);
                match conversion {
                    'u' => (v as u32).to_string(),
                    'x' => format!("{:x}", v as u32),
                    'X' => format!("{:X}", v as u32),
                    'c' => char::from_u32(v as u32).unwrap_or('?').to_string(),
                    _ => v.to_string(),
                }
            }
            None => break,
        };
        let pad = width.saturating_sub(value.len());
        out.extend(std::iter::repeat_n(if zero { '0' } else { ' ' }, pad));
        out.push_str(&value);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libjpeg_messages_are_formatted_like_printf() {
        let ints = [3, 0xd9, 0, 0, 0, 0, 0, 0];
        assert_eq!(
            printf(
                "Corrupt JPEG data: %u extraneous bytes before marker 0x%02x",
                &ints,
                ""
            ),
            "Corrupt JPEG data: 3 extraneous bytes before marker 0xd9"
        );
        assert_eq!(printf("Bogus %s (%4u)", &[7; 8], "x"), "Bogus x (   7)");
    }

    #[test]
    fn cmyk_follows_pillows_integer_rounding() {
        // Stored (Adobe, inverted) samples: 255 is no ink.
        assert_eq!(cmyk_inverted_to_rgb([255, 255, 255, 255]), [255, 255, 255]);
        assert_eq!(cmyk_inverted_to_rgb([0, 0, 0, 0]), [0, 0, 0]);
        // c = 155, k = 55: nk = 200, 200 - MULDIV255(155, 200) = 200 - 122 = 78
        assert_eq!(cmyk_inverted_to_rgb([100, 255, 0, 200]), [78, 200, 0]);
    }
}
