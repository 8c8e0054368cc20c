//! The headers of the files klein decodes, read the way Pillow reads them before it decodes any
//! pixel (`JpegImagePlugin._open`, `PngImagePlugin._open` and `load_end`, `WebPImagePlugin._open`):
//! the format, the stored size (before EXIF orientation) and the metadata Pillow may read an
//! orientation from (`Image.getexif`). Nothing here allocates for pixels.
use std::io::Cursor;

use super::header::ImageFormat;

/// `Image.info` entries that `Image.getexif` reads an orientation from.
#[derive(Debug, Default)]
pub(super) struct Metadata {
    /// `info["exif"]`: the JPEG APP1 `Exif` segment (later ones appended without their prefix),
    /// a PNG `eXIf` chunk (with an `Exif\0\0` prefix) or `tEXt` chunk named `exif`, the WebP
    /// `EXIF` chunk.
    pub exif: Option<Vec<u8>>,
    /// `info["Raw profile type exif"]`: a PNG text chunk (ImageMagick's hex dump of the EXIF).
    pub raw_profile_exif: Option<String>,
    /// `info["XML:com.adobe.xmp"]`: a PNG text chunk.
    pub xmp_text: Option<String>,
    /// `info["xmp"]`: a JPEG APP1 XMP segment, a PNG `iTXt` chunk named `XML:com.adobe.xmp`, the
    /// WebP `XMP ` chunk.
    pub xmp: Option<Vec<u8>>,
}

/// What a file's header says.
#[derive(Debug)]
pub(super) struct Container {
    pub format: ImageFormat,
    /// The stored size, before EXIF orientation.
    pub width: u32,
    pub height: u32,
    /// Bytes per pixel of the decoder's output buffer (the largest allocation of the decoding).
    pub bytes_per_pixel: u64,
    pub metadata: Metadata,
}

/// Reads the header of a PNG, JPEG or WebP file; `Err` says why the file is refused.
pub(super) fn read(bytes: &[u8]) -> Result<Container, String> {
    match ImageFormat::sniff(bytes) {
        Some(ImageFormat::Jpeg) => jpeg(bytes),
        Some(ImageFormat::Png) => png(bytes),
        Some(ImageFormat::WebP) => webp(bytes),
        None => Err(match other_format(bytes) {
            Some(name) => format!(
                "unsupported image ({name}); klein decodes {}, exactly as Pillow does: convert it \
                 to one of those",
                ImageFormat::LIST
            ),
            None => format!(
                "not a {} image (unrecognised file signature)",
                ImageFormat::ANY
            ),
        }),
    }
}

/// Formats Pillow opens that klein refuses, named in the refusal.
fn other_format(bytes: &[u8]) -> Option<&'static str> {
    let signatures: [(&[u8], &str); 8] = [
        (b"GIF8", "GIF"),
        (b"BM", "BMP"),
        (b"II*\0", "TIFF"),
        (b"MM\0*", "TIFF"),
        (b"\0\0\0\x0cjP  ", "JPEG 2000"),
        (b"\xff\x4f\xff\x51", "JPEG 2000"),
        (b"8BPS", "PSD"),
        (b"RIFF", "RIFF (not a WebP image Pillow opens)"),
    ];
    if bytes.len() >= 12 && &bytes[4..8] == b"ftyp" {
        return Some("HEIF/AVIF");
    }
    signatures
        .iter()
        .find(|(magic, _)| bytes.starts_with(magic))
        .map(|(_, name)| *name)
}

fn be16(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from(u16::from_be_bytes(
        bytes.get(at..at + 2)?.try_into().ok()?,
    )))
}

fn be32(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

const TRUNCATED: &str =
    "cannot decode (the file ends inside its header); the file may be truncated";

/// `JpegImageFile._open`: markers from SOI up to the first SOS.
fn jpeg(bytes: &[u8]) -> Result<Container, String> {
    const XMP: &[u8] = b"http://ns.adobe.com/xap/1.0/\0";
    let mut metadata = Metadata::default();
    let mut frame: Option<(u32, u32, u8)> = None;
    let mut lossless = false;
    // After the FF D8 FF signature, Pillow's loop starts from the last FF.
    let mut at = 2;
    loop {
        let Some(&byte) = bytes.get(at) else {
            return Err(TRUNCATED.to_string());
        };
        if byte != 0xFF {
            at += 1; // Pillow skips junk between markers
            continue;
        }
        let Some(&code) = bytes.get(at + 1) else {
            return Err(TRUNCATED.to_string());
        };
        match code {
            // padding (FF FF) and escaped data (FF 00)
            0xFF => at += 1,
            0x00 => at += 2,
            // markers without a length: TEM is not in Pillow's table
            0xD0..=0xD9 | 0xC8 | 0xF0..=0xFD => at += 2,
            0xC0..=0xFE => {
                let length = be16(bytes, at + 2).ok_or(TRUNCATED)? as usize;
                let start = at + 4;
                // Pillow reads `length - 2` bytes, nothing when the length is under 2.
                let end = start + length.saturating_sub(2);
                let segment = bytes.get(start..end).ok_or(TRUNCATED)?;
                match code {
                    0xE1 if segment.starts_with(b"Exif\0\0") => match &mut metadata.exif {
                        Some(exif) => exif.extend_from_slice(&segment[6..]),
                        None => metadata.exif = Some(segment.to_vec()),
                    },
                    0xE1 if segment.starts_with(XMP) => {
                        metadata.xmp = Some(segment[XMP.len()..].to_vec());
                    }
                    0xDB => dqt(segment)?,
                    0xC0..=0xC3 | 0xC5..=0xC7 | 0xC9..=0xCB | 0xCD..=0xCF | 0xDE => {
                        frame = Some(sof(segment)?);
                        lossless = matches!(code, 0xC3 | 0xC7 | 0xCB | 0xCF);
                    }
                    0xDA => break,
                    _ => {}
                }
                at = end;
            }
            other => return Err(format!("cannot decode (no JPEG marker at 0xFF{other:02X})")),
        }
    }
    let (width, height, layers) =
        frame.ok_or("cannot decode (a JPEG scan before any frame header)")?;
    if width == 0 || height == 0 {
        return Err(format!("cannot decode (a {width}x{height} JPEG frame)"));
    }
    if lossless {
        // libjpeg-turbo 3 decodes lossless JPEG (Pillow's does); the 2.1 decoder here does not.
        return Err(
            "unsupported image (lossless JPEG), which klein cannot decode as Pillow does: convert \
             it to PNG"
                .to_string(),
        );
    }
    Ok(Container {
        format: ImageFormat::Jpeg,
        width,
        height,
        bytes_per_pixel: u64::from(layers),
        metadata,
    })
}

/// Pillow's SOF handler: size, 8-bit samples only, 1, 3 or 4 components.
fn sof(segment: &[u8]) -> Result<(u32, u32, u8), String> {
    let (Some(height), Some(width), Some(&layers)) =
        (be16(segment, 1), be16(segment, 3), segment.get(5))
    else {
        return Err("cannot decode (a JPEG frame header too short)".to_string());
    };
    match (segment[0], layers) {
        (8, 1 | 3 | 4) => Ok((width, height, layers)),
        (8, n) => Err(format!(
            "cannot decode a JPEG with {n} colour components (Pillow opens 1, 3 or 4)"
        )),
        (bits, _) => Err(format!(
            "cannot decode a {bits}-bit JPEG (Pillow opens 8-bit JPEGs only)"
        )),
    }
}

/// Pillow's DQT handler refuses a table shorter than its precision says.
fn dqt(mut segment: &[u8]) -> Result<(), String> {
    while let Some(&v) = segment.first() {
        let length = 1 + if v >> 4 == 0 { 64 } else { 128 };
        segment = segment
            .get(length..)
            .ok_or("cannot decode (a bad JPEG quantization table)")?;
    }
    Ok(())
}

/// The `(bit depth, colour type)` pairs Pillow opens (`PngImagePlugin._MODES`) and the bytes per
/// pixel they decode to.
fn png_bytes_per_pixel(depth: u8, colour: u8) -> Option<u64> {
    let channels = match (depth, colour) {
        (1 | 2 | 4 | 8 | 16, 0) | (1 | 2 | 4 | 8, 3) => 1,
        (8 | 16, 2) => 3,
        (8 | 16, 4) => 2,
        (8 | 16, 6) => 4,
        _ => return None,
    };
    Some(channels * u64::from(depth).div_ceil(8))
}

/// `PngImageFile._open` (chunks up to the first IDAT, with their checksums) and `load_end` (the
/// chunks after the image data, whose text and EXIF Pillow reads too).
fn png(bytes: &[u8]) -> Result<Container, String> {
    let mut metadata = Metadata::default();
    let mut header: Option<(u32, u32, u64)> = None;
    let mut frames: Option<u32> = None; // acTL num_frames
    let mut fctl_before_idat = false;
    let mut after_idat = false;
    let mut at = 8;
    loop {
        let (Some(length), Some(kind)) = (be32(bytes, at), bytes.get(at + 4..at + 8)) else {
            if after_idat {
                break; // Pillow stops quietly at the end of the file once the pixels are read
            }
            return Err(TRUNCATED.to_string());
        };
        if !kind.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_') {
            if after_idat {
                break;
            }
            return Err(format!(
                "cannot decode (broken PNG file: chunk {:?})",
                String::from_utf8_lossy(kind)
            ));
        }
        let start = at + 8;
        let data = start
            .checked_add(length as usize)
            .and_then(|end| bytes.get(start..end));
        match kind {
            b"IEND" if after_idat => break,
            b"fcTL" if after_idat => {
                // Pillow stops at the next frame of an animation.
                let animated = frames.is_some_and(|n| n + u32::from(!fctl_before_idat) > 1);
                if animated {
                    break;
                }
            }
            b"IDAT" | b"fdAT" => {
                // The pixels: Pillow's decoder reads them, not the header parser.
                after_idat = true;
                at = start.saturating_add(length as usize).saturating_add(4);
                continue;
            }
            _ => {}
        }
        let data = data.ok_or(TRUNCATED)?;
        if !after_idat {
            let crc = be32(bytes, start + data.len()).ok_or(TRUNCATED)?;
            let mut hasher = crc32fast::Hasher::new();
            hasher.update(kind);
            hasher.update(data);
            if hasher.finalize() != crc {
                return Err(format!(
                    "cannot decode (broken PNG file: bad checksum in {})",
                    String::from_utf8_lossy(kind)
                ));
            }
        }
        match kind {
            b"IHDR" if !after_idat => {
                let (Some(width), Some(height), Some(&depth), Some(&colour)) =
                    (be32(data, 0), be32(data, 4), data.get(8), data.get(9))
                else {
                    return Err("cannot decode (truncated PNG IHDR chunk)".to_string());
                };
                let bytes_per_pixel = png_bytes_per_pixel(depth, colour).ok_or_else(|| {
                    format!("cannot decode a PNG of colour type {colour} at {depth} bits")
                })?;
                header = Some((width, height, bytes_per_pixel));
            }
            b"acTL" if !after_idat => {
                frames = be32(data, 0).filter(|&n| n > 0 && n <= 1 << 31);
            }
            b"fcTL" => fctl_before_idat = true,
            b"eXIf" => {
                let mut exif = b"Exif\0\0".to_vec();
                exif.extend_from_slice(data);
                metadata.exif = Some(exif);
            }
            b"tEXt" | b"zTXt" | b"iTXt" => png_text(kind, data, &mut metadata)?,
            _ => {}
        }
        at = start + data.len() + 4;
    }
    let (width, height, bytes_per_pixel) = header.ok_or("cannot decode (a PNG without IHDR)")?;
    Ok(Container {
        format: ImageFormat::Png,
        width,
        height,
        bytes_per_pixel,
        metadata,
    })
}

/// Largest decompressed text chunk (`PngImagePlugin.MAX_TEXT_CHUNK`, Pillow's `SAFEBLOCK`).
const MAX_TEXT_CHUNK: usize = 1024 * 1024;

/// `zlib.decompressobj().decompress(data, MAX_TEXT_CHUNK)`: `Ok(None)` for corrupt data (Pillow
/// drops the value), an error past the limit (Pillow raises).
fn inflate(data: &[u8]) -> Result<Option<Vec<u8>>, String> {
    match miniz_oxide::inflate::decompress_to_vec_zlib_with_limit(data, MAX_TEXT_CHUNK) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.status == miniz_oxide::inflate::TINFLStatus::HasMoreOutput => {
            Err("cannot decode (a PNG text chunk over Pillow's MAX_TEXT_CHUNK)".to_string())
        }
        // A truncated stream gives Python what it could inflate.
        Err(e) if e.status == miniz_oxide::inflate::TINFLStatus::FailedCannotMakeProgress => {
            Ok(Some(e.output))
        }
        Err(_) => Ok(None),
    }
}

fn latin1(bytes: &[u8]) -> String {
    bytes.iter().map(|&b| char::from(b)).collect()
}

/// `chunk_tEXt`, `chunk_zTXt`, `chunk_iTXt`, for the keys `Image.getexif` reads.
fn png_text(kind: &[u8], data: &[u8], metadata: &mut Metadata) -> Result<(), String> {
    let (key, value) = match data.iter().position(|&b| b == 0) {
        Some(nul) => (&data[..nul], &data[nul + 1..]),
        None => (data, &[][..]),
    };
    let value: Vec<u8> = match kind {
        b"tEXt" => {
            if key == b"exif" {
                metadata.exif = Some(value.to_vec());
                return Ok(());
            }
            value.to_vec()
        }
        b"zTXt" => {
            let method = value.first().copied().unwrap_or(0);
            if method != 0 {
                return Err(format!(
                    "cannot decode (unknown compression method {method} in a PNG zTXt chunk)"
                ));
            }
            inflate(value.get(1..).unwrap_or(&[]))?.unwrap_or_default()
        }
        _ => {
            // iTXt: key \0 compressed method language \0 translated key \0 text
            if data.len() == key.len() || value.len() < 2 {
                return Ok(());
            }
            let (compressed, method, rest) = (value[0], value[1], &value[2..]);
            let mut parts = rest.splitn(3, |&b| b == 0);
            let (Some(language), Some(translated), Some(text)) =
                (parts.next(), parts.next(), parts.next())
            else {
                return Ok(());
            };
            let text = match (compressed, method) {
                (0, _) => text.to_vec(),
                (_, 0) => match inflate(text)? {
                    Some(text) => text,
                    None => return Ok(()),
                },
                _ => return Ok(()),
            };
            if key == b"XML:com.adobe.xmp" {
                metadata.xmp = Some(text.clone());
            }
            // Pillow keeps the value only if it, the language and the translated key are UTF-8.
            if std::str::from_utf8(language).is_err() || std::str::from_utf8(translated).is_err() {
                return Ok(());
            }
            let Ok(text) = String::from_utf8(text) else {
                return Ok(());
            };
            text.into_bytes()
        }
    };
    if key.is_empty() {
        return Ok(());
    }
    let text = if kind == b"iTXt" {
        String::from_utf8_lossy(&value).into_owned()
    } else {
        latin1(&value)
    };
    match key {
        b"Raw profile type exif" => metadata.raw_profile_exif = Some(text),
        b"XML:com.adobe.xmp" => metadata.xmp_text = Some(text),
        b"exif" => {
            return Err(
                "cannot decode (a compressed PNG text chunk named exif, which Pillow fails on)"
                    .to_string(),
            )
        }
        _ => {}
    }
    Ok(())
}

/// `WebPImagePlugin._open`: the canvas size and the EXIF and XMP chunks of libwebp's demuxer.
fn webp(bytes: &[u8]) -> Result<Container, String> {
    let riff = webp_riff(bytes)?;
    let mut decoder = image_webp::WebPDecoder::new(Cursor::new(riff))
        .map_err(|e| format!("cannot decode ({e}); the file may be corrupt or truncated"))?;
    let (width, height) = decoder.dimensions();
    // Pillow keeps a chunk only if it is not empty.
    let exif = decoder
        .exif_metadata()
        .map_err(|e| format!("cannot decode ({e})"))?
        .filter(|c| !c.is_empty());
    let xmp = decoder
        .xmp_metadata()
        .map_err(|e| format!("cannot decode ({e})"))?
        .filter(|c| !c.is_empty());
    Ok(Container {
        format: ImageFormat::WebP,
        width,
        height,
        bytes_per_pixel: 4,
        metadata: Metadata {
            exif,
            xmp,
            ..Metadata::default()
        },
    })
}

/// The RIFF chunk of a WebP file, as libwebp's demuxer (`ReadHeader` of `demux.c`, under Pillow's
/// `WebPAnimDecoder`) takes it: a size of at least 8 and at most `MAX_CHUNK_PAYLOAD`, the whole
/// chunk in the file (a partial file is refused), bytes after it ignored.
pub(super) fn webp_riff(bytes: &[u8]) -> Result<&[u8], String> {
    const MAX_CHUNK_PAYLOAD: u32 = !0 - 8 - 1;
    let size = bytes
        .get(4..8)
        .filter(|_| bytes.len() >= 20)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .ok_or(TRUNCATED)?;
    if !(8..=MAX_CHUNK_PAYLOAD).contains(&size) {
        return Err(format!(
            "cannot decode (a RIFF size of {size}, which libwebp refuses)"
        ));
    }
    let end = size as usize + 8;
    bytes.get(..end).ok_or_else(|| {
        format!(
            "cannot decode (the RIFF header says {end} bytes, the file has {}; libwebp refuses a \
             partial file); the file may be truncated",
            bytes.len()
        )
    })
}
