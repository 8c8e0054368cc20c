//! `ImageOps.exif_transpose` as Pillow 13 does it: where the orientation comes from
//! (`Image.getexif`: `info["exif"]`, else a PNG "Raw profile type exif" text; then, only when that
//! has no Orientation tag, the first `tiff:Orientation` of the XMP), how the first IFD of the EXIF
//! is read (`ImageFileDirectory_v2.load`: first stored entry of a tag wins, entries of unknown type
//! or with no data are skipped, reading stops at the first entry whose data is out of range), which
//! values transpose (a number equal to 2..8, whatever its TIFF type), and the transposition.
use image::RgbImage;

use super::container::Metadata;

/// The EXIF Orientation tag (`ExifTags.Base.Orientation`).
const ORIENTATION: u16 = 0x0112;

/// The orientation Pillow applies, 1 (none) to 8; `Err` where Pillow raises.
pub(super) fn orientation(metadata: &Metadata) -> Result<u8, String> {
    let exif = match (&metadata.exif, &metadata.raw_profile_exif) {
        (Some(exif), _) => Some(exif.clone()),
        // `bytes.fromhex("".join(value.split("\n")[3:]))`
        (None, Some(text)) => Some(from_hex(&text.split('\n').skip(3).collect::<String>())?),
        (None, None) => None,
    };
    let tag = match exif {
        Some(exif) => exif_tag(&exif)?,
        None => None,
    };
    let value = match tag {
        Some(value) => value,
        None => xmp_orientation(metadata),
    };
    Ok(if (2..=8).contains(&value) { value } else { 1 })
}

/// `bytes.fromhex`: pairs of hex digits, whitespace allowed between pairs.
fn from_hex(text: &str) -> Result<Vec<u8>, String> {
    let bad = || "a PNG \"Raw profile type exif\" text that is not hex (Pillow fails on it)";
    let mut bytes = Vec::new();
    let mut digits = text.chars().filter(|c| !c.is_ascii_whitespace());
    let pairs = text.chars().filter(|c| !c.is_ascii_whitespace()).count();
    if pairs % 2 != 0 {
        return Err(bad().to_string());
    }
    while let (Some(high), Some(low)) = (digits.next(), digits.next()) {
        let (Some(high), Some(low)) = (high.to_digit(16), low.to_digit(16)) else {
            return Err(bad().to_string());
        };
        bytes.push((high * 16 + low) as u8);
    }
    Ok(bytes)
}

/// `re.search(rb'tiff:Orientation(="|>)([0-9])', xmp)`, on `info["XML:com.adobe.xmp"]` if it is
/// not empty, else on `info["xmp"]`; 0 when there is no match.
fn xmp_orientation(metadata: &Metadata) -> u8 {
    let text = match (&metadata.xmp_text, &metadata.xmp) {
        (Some(text), _) if !text.is_empty() => text.as_bytes(),
        (_, Some(xmp)) => xmp.as_slice(),
        _ => return 0,
    };
    const KEY: &[u8] = b"tiff:Orientation";
    text.windows(KEY.len() + 2)
        .enumerate()
        .filter(|(_, w)| w.starts_with(KEY))
        .find_map(|(at, _)| {
            let rest = &text[at + KEY.len()..];
            let digit = match rest {
                [b'=', b'"', d, ..] | [b'>', d, ..] => *d,
                _ => return None,
            };
            digit.is_ascii_digit().then(|| digit - b'0')
        })
        .unwrap_or(0)
}

/// A TIFF reader over the EXIF bytes, in the byte order of their header.
struct Tiff<'a> {
    data: &'a [u8],
    big_endian: bool,
}

impl Tiff<'_> {
    fn bytes<const N: usize>(&self, at: usize) -> Option<[u8; N]> {
        let mut b: [u8; N] = self.data.get(at..at.checked_add(N)?)?.try_into().ok()?;
        if !self.big_endian {
            b.reverse();
        }
        Some(b) // big-endian order
    }
    fn u16(&self, at: usize) -> Option<u16> {
        self.bytes(at).map(u16::from_be_bytes)
    }
    fn u32(&self, at: usize) -> Option<u32> {
        self.bytes(at).map(u32::from_be_bytes)
    }
}

/// The Orientation entry of the first IFD: `None` when absent, else its value as Pillow's
/// `exif.get(0x0112)` gives it, reduced to the integer it equals (0 for anything else).
fn exif_tag(exif: &[u8]) -> Result<Option<u8>, String> {
    // `re.sub(b"^(Exif\x00\x00){1,2}", b"", data)`
    let mut data = exif;
    for _ in 0..2 {
        data = data.strip_prefix(b"Exif\0\0").unwrap_or(data);
    }
    if data.is_empty() {
        return Ok(None);
    }
    let big_endian = match data.get(..4) {
        Some(b"MM\0*" | b"MM*\0") => true,
        Some(b"II*\0" | b"II\0*") => false,
        Some(b"MM\0+" | b"II+\0") => {
            return Err("BigTIFF EXIF data, which klein does not read".to_string())
        }
        _ => {
            return Err(
                "EXIF data without a TIFF header (Pillow fails on it: \"not a TIFF file\")"
                    .to_string(),
            )
        }
    };
    let tiff = Tiff { data, big_endian };
    let first_ifd = tiff
        .u32(4)
        .ok_or("EXIF data shorter than a TIFF header (Pillow fails on it)")?;
    let ifd = first_ifd as usize;
    // A short read ends `load` quietly (Pillow warns): no tag then.
    let Some(count) = tiff.u16(ifd) else {
        return Ok(None);
    };
    // Out-of-line data may not add up to more than the whole EXIF (Pillow skips the tag).
    let mut out_of_line = 0usize;
    for i in 0..usize::from(count) {
        let entry = ifd + 2 + 12 * i;
        // A short entry ends `load` (Pillow warns).
        let (Some(tag), Some(kind), Some(n), Some(inline)) = (
            tiff.u16(entry),
            tiff.u16(entry + 2),
            tiff.u32(entry + 4),
            tiff.u32(entry + 8),
        ) else {
            return Ok(None);
        };
        let Some(unit) = unit_size(kind) else {
            continue; // unsupported type: skipped
        };
        let size = (n as usize).saturating_mul(unit);
        if size == 0 {
            continue; // no data: skipped
        }
        let at = if size > 4 {
            out_of_line += size;
            if out_of_line > data.len() {
                continue;
            }
            // `_safe_read` raises past the end, and `load` stops there.
            if (inline as usize).saturating_add(size) > data.len() {
                return Ok(None);
            }
            inline as usize
        } else {
            entry + 8
        };
        if tag == ORIENTATION {
            // The first stored entry of a tag is the one Pillow keeps.
            return Ok(Some(first_integer(&tiff, kind, at)));
        }
    }
    Ok(None)
}

/// Bytes per value of the TIFF types Pillow loads (`_load_dispatch`); `None` for the others.
fn unit_size(kind: u16) -> Option<usize> {
    Some(match kind {
        1 | 2 | 6 | 7 => 1,
        3 | 8 => 2,
        4 | 9 | 11 | 13 => 4,
        5 | 10 | 12 | 16 => 8,
        _ => return None,
    })
}

/// The first value of an entry if it equals an integer in 1..=8 (Pillow keeps the first value of
/// a tag specified with one, and looks it up in a dict of ints: 6, 6.0 and 12/2 all match), else 0.
/// BYTE, ASCII and UNDEFINED values are bytes or text to Pillow: never a match.
fn first_integer(tiff: &Tiff<'_>, kind: u16, at: usize) -> u8 {
    let number: Option<f64> = match kind {
        3 => tiff.u16(at).map(f64::from),
        8 => tiff.u16(at).map(|v| f64::from(v as i16)),
        4 | 13 => tiff.u32(at).map(f64::from),
        9 => tiff.u32(at).map(|v| f64::from(v as i32)),
        6 => tiff.data.get(at).map(|&v| f64::from(v as i8)),
        16 => tiff.bytes::<8>(at).map(|b| u64::from_be_bytes(b) as f64),
        11 => tiff.u32(at).map(|v| f64::from(f32::from_bits(v))),
        12 => tiff
            .bytes::<8>(at)
            .map(|b| f64::from_bits(u64::from_be_bytes(b))),
        5 | 10 => match (tiff.u32(at), tiff.u32(at + 4)) {
            (Some(num), Some(den)) if kind == 5 && den != 0 && num % den == 0 => {
                Some(f64::from(num / den))
            }
            (Some(num), Some(den)) if kind == 10 && den != 0 => {
                let (num, den) = (num as i32, den as i32);
                (num % den == 0).then(|| f64::from(num / den))
            }
            _ => None,
        },
        _ => None,
    };
    match number {
        Some(n) if n.fract() == 0.0 && (1.0..=8.0).contains(&n) => n as u8,
        _ => 0,
    }
}

/// `Image.transpose` for each orientation (the `method` table of `exif_transpose`).
pub(super) fn transpose(image: RgbImage, orientation: u8) -> RgbImage {
    use image::imageops;
    let (w, h) = image.dimensions();
    match orientation {
        // FLIP_LEFT_RIGHT, ROTATE_180, FLIP_TOP_BOTTOM
        2 => imageops::flip_horizontal(&image),
        3 => imageops::rotate180(&image),
        4 => imageops::flip_vertical(&image),
        // TRANSPOSE: [h, w] -> [w, h], out(x, y) = in(y, x)
        5 => RgbImage::from_fn(h, w, |x, y| *image.get_pixel(y, x)),
        // ROTATE_270 (counter-clockwise), i.e. 90 degrees clockwise
        6 => imageops::rotate90(&image),
        // TRANSVERSE: out(x, y) = in(w - 1 - y, h - 1 - x)
        7 => RgbImage::from_fn(h, w, |x, y| *image.get_pixel(w - 1 - y, h - 1 - x)),
        // ROTATE_90 (counter-clockwise)
        8 => imageops::rotate270(&image),
        _ => image,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    /// A TIFF header and a first IFD holding one Orientation entry.
    fn exif_with(kind: u16, count: u32, value: [u8; 4], big_endian: bool) -> Vec<u8> {
        let u16b = |v: u16| {
            if big_endian {
                v.to_be_bytes()
            } else {
                v.to_le_bytes()
            }
        };
        let u32b = |v: u32| {
            if big_endian {
                v.to_be_bytes()
            } else {
                v.to_le_bytes()
            }
        };
        let mut tiff = if big_endian {
            b"MM\0*".to_vec()
        } else {
            b"II*\0".to_vec()
        };
        tiff.extend(u32b(8));
        tiff.extend(u16b(1));
        tiff.extend(u16b(ORIENTATION));
        tiff.extend(u16b(kind));
        tiff.extend(u32b(count));
        tiff.extend(value);
        tiff.extend(u32b(0));
        tiff
    }

    fn with_exif(exif: Vec<u8>) -> Metadata {
        Metadata {
            exif: Some(exif),
            ..Metadata::default()
        }
    }

    #[test]
    fn orientation_values_follow_pillow_types() {
        // SHORT 6 little-endian, SHORT 3 big-endian, LONG 8, SSHORT 5
        let cases = [
            (exif_with(3, 1, [6, 0, 0, 0], false), 6),
            (exif_with(3, 1, [0, 3, 0, 0], true), 3),
            (exif_with(4, 1, [8, 0, 0, 0], false), 8),
            (exif_with(8, 1, [5, 0, 0, 0], false), 5),
            // BYTE and ASCII are bytes and text to Pillow: no transposition
            (exif_with(1, 1, [6, 0, 0, 0], false), 1),
            (exif_with(2, 2, [b'6', 0, 0, 0], false), 1),
            // two SHORTs: Pillow keeps the first
            (exif_with(3, 2, [7, 0, 2, 0], false), 7),
            // an unknown type is skipped; 9 is no orientation
            (exif_with(99, 1, [6, 0, 0, 0], false), 1),
            (exif_with(3, 1, [9, 0, 0, 0], false), 1),
        ];
        for (i, (exif, want)) in cases.into_iter().enumerate() {
            assert_eq!(orientation(&with_exif(exif)).unwrap(), want, "case {i}");
        }
    }

    #[test]
    fn xmp_is_read_only_without_an_exif_orientation_tag() {
        let xmp = br#"<rdf:Description tiff:Orientation="6"/>"#.to_vec();
        let only_xmp = Metadata {
            xmp: Some(xmp.clone()),
            ..Metadata::default()
        };
        assert_eq!(orientation(&only_xmp).unwrap(), 6);
        let element = Metadata {
            xmp_text: Some("<tiff:Orientation>8</tiff:Orientation>".into()),
            ..Metadata::default()
        };
        assert_eq!(orientation(&element).unwrap(), 8);
        let both = Metadata {
            exif: Some(exif_with(3, 1, [3, 0, 0, 0], false)),
            xmp: Some(xmp),
            ..Metadata::default()
        };
        assert_eq!(orientation(&both).unwrap(), 3);
        // an unusable EXIF value still hides the XMP
        let hidden = Metadata {
            exif: Some(exif_with(1, 1, [6, 0, 0, 0], false)),
            xmp: Some(br#"tiff:Orientation="6""#.to_vec()),
            ..Metadata::default()
        };
        assert_eq!(orientation(&hidden).unwrap(), 1);
    }

    #[test]
    fn malformed_exif_is_refused_or_ignored_as_pillow_does() {
        // no TIFF header: Pillow raises
        assert!(orientation(&with_exif(b"Exif\0\0JUNKJUNK".to_vec())).is_err());
        // a first IFD past the end: Pillow warns and finds no tag
        let mut far = exif_with(3, 1, [6, 0, 0, 0], false);
        far[4] = 200;
        assert_eq!(orientation(&with_exif(far)).unwrap(), 1);
        // only the prefix
        assert_eq!(orientation(&with_exif(b"Exif\0\0".to_vec())).unwrap(), 1);
    }

    #[test]
    fn raw_profile_text_is_hex_after_three_lines() {
        let exif = exif_with(3, 1, [5, 0, 0, 0], false);
        let hex: String = exif.iter().map(|b| format!("{b:02x}")).collect();
        let text = format!("\nexif\n{:8}\n{hex}\n", exif.len());
        let metadata = Metadata {
            raw_profile_exif: Some(text),
            ..Metadata::default()
        };
        assert_eq!(orientation(&metadata).unwrap(), 5);
        let bad = Metadata {
            raw_profile_exif: Some("\nexif\n 4\nzz\n".into()),
            ..Metadata::default()
        };
        assert!(orientation(&bad).is_err());
    }
}
