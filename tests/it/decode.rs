//! The decoding contract: a reference file gives the pixels of `diffusers.utils.load_image(path)`
//! (Pillow's decoders, `ImageOps.exif_transpose`, `convert("RGB")`), bit for bit.
//!
//! Corpus: `tests/fixtures/decode/`, made by `tests/fixtures/make_decode_corpus.py` with Pillow's
//! and libjpeg-turbo's encoders; `expected.safetensors` holds Pillow's uint8 `[H, W, 3]` per file
//! and, in its metadata, the files Pillow refuses. Tolerance 0 on every file; a failure names the
//! file and its first differing pixel. `KLEIN_DECODE_CORPUS=<dir>` runs the same check on another
//! folder laid out the same way (files and `expected.safetensors`).
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use klein::stages::reference::{decode_image, decode_image_bytes, read_header, ImageFormat};
use klein::KleinError;
use safetensors::{Dtype, SafeTensors};

use crate::util::fixture;

fn corpus() -> PathBuf {
    std::env::var_os("KLEIN_DECODE_CORPUS").map_or_else(|| fixture("decode"), PathBuf::from)
}

/// Pillow's pixels per file: shape `[H, W, 3]` and uint8 values.
type Pixels = BTreeMap<String, (Vec<usize>, Vec<u8>)>;

/// Pillow's pixels per file, and the files Pillow refuses with its message.
fn expected() -> (Pixels, BTreeMap<String, String>) {
    let bytes = std::fs::read(corpus().join("expected.safetensors")).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let refused: BTreeMap<String, String> =
        serde_json::from_str(&header.metadata().as_ref().unwrap()["refused"]).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let pixels = tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), Dtype::U8, "{name}");
            (name, (view.shape().to_vec(), view.data().to_vec()))
        })
        .collect();
    (pixels, refused)
}

/// Every image file of the corpus (the expected file excepted).
fn corpus_files() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(corpus())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "expected.safetensors")
        .collect();
    names.sort();
    names
}

/// `None` when equal, else what differs: the shape, or the count of differing pixels and the first.
fn compare(shape: &[usize], want: &[u8], got: &image::RgbImage) -> Option<String> {
    let got_shape = [got.height() as usize, got.width() as usize, 3];
    if shape != got_shape {
        return Some(format!("shape: Pillow {shape:?}, klein {got_shape:?}"));
    }
    let width = shape[1];
    let differing: Vec<usize> = want
        .chunks_exact(3)
        .zip(got.as_raw().chunks_exact(3))
        .enumerate()
        .filter(|(_, (w, g))| w != g)
        .map(|(i, _)| i)
        .collect();
    let &first = differing.first()?;
    let (x, y) = (first % width, first / width);
    let max = want
        .iter()
        .zip(got.as_raw())
        .map(|(w, g)| w.abs_diff(*g))
        .max()
        .unwrap_or(0);
    Some(format!(
        "{} of {} pixels differ (max {max} levels); first at (x {x}, y {y}): \
         Pillow {:?}, klein {:?}",
        differing.len(),
        want.len() / 3,
        &want[first * 3..first * 3 + 3],
        &got.as_raw()[first * 3..first * 3 + 3],
    ))
}

#[test]
fn every_corpus_file_decodes_to_pillows_pixels() {
    let (expected, refused) = expected();
    let files = corpus_files();
    if std::env::var_os("KLEIN_DECODE_CORPUS").is_none() {
        assert!(files.len() >= 80, "the corpus holds {} files", files.len());
    }
    let mut report = Vec::new();
    let mut failures = 0;
    for name in &files {
        let path = corpus().join(name);
        let got = decode_image(&path);
        let line = match (expected.get(name), refused.get(name), got) {
            (Some((shape, want)), _, Ok(got)) => match compare(shape, want, &got) {
                None => "PASS (bit-exact)".to_string(),
                Some(diff) => {
                    failures += 1;
                    format!("FAIL: {diff}")
                }
            },
            (Some(_), _, Err(e)) => {
                failures += 1;
                format!("FAIL: Pillow decodes it, klein refuses: {e}")
            }
            (None, Some(pillow), Err(KleinError::Image { path: p, reason })) => {
                assert_eq!(p, path, "{name}: the error names the file");
                format!("PASS (refused like Pillow: klein \"{reason}\", Pillow \"{pillow}\")")
            }
            (None, Some(pillow), Ok(got)) => {
                failures += 1;
                let (w, h) = got.dimensions();
                format!("FAIL: Pillow refuses it (\"{pillow}\"), klein decodes it ({w}x{h})")
            }
            (None, Some(_), Err(other)) => {
                failures += 1;
                format!("FAIL: Pillow refuses it, klein fails with another error: {other}")
            }
            (None, None, _) => {
                failures += 1;
                "FAIL: not in expected.safetensors (rerun make_decode_corpus.py)".to_string()
            }
        };
        report.push(format!("{name}: {line}"));
    }
    eprintln!("{}", report.join("\n"));
    eprintln!("{} files, {failures} failures", files.len());
    assert_eq!(
        failures,
        0,
        "{failures} of {} files:\n{}",
        files.len(),
        report.join("\n")
    );
}

/// `read_header` gives the oriented size `load_image` gives, and the format, for every file
/// Pillow decodes, without decoding pixels.
#[test]
fn headers_give_the_oriented_size() {
    let (expected, _) = expected();
    for (name, (shape, _)) in &expected {
        let header = read_header(&corpus().join(name)).unwrap();
        assert_eq!(
            [header.height as usize, header.width as usize],
            shape[..2],
            "{name}: header {header:?}"
        );
        let format = match Path::new(name).extension().and_then(|e| e.to_str()) {
            Some("jpg") => ImageFormat::Jpeg,
            Some("png") => ImageFormat::Png,
            _ => ImageFormat::WebP,
        };
        assert_eq!(header.format, format, "{name}");
    }
    let rotated = read_header(&corpus().join("j_orient6.jpg")).unwrap();
    assert_eq!(
        (rotated.width, rotated.height, rotated.orientation),
        (16, 24, 6)
    );
}

/// `jpeg` with a comment segment of `len` bytes (marker included) inserted after SOI.
fn with_comment(jpeg: &[u8], len: usize) -> Vec<u8> {
    let payload = len - 4;
    let mut out = jpeg[..2].to_vec();
    out.extend([0xFF, 0xFE]);
    out.extend(u16::try_from(payload + 2).unwrap().to_be_bytes());
    out.extend(vec![0u8; payload]);
    out.extend(&jpeg[2..]);
    out
}

/// Pillow hands libjpeg the file in 64 KiB blocks and resumes it after each suspension; a Huffman
/// scan, or a marker segment libjpeg skips, across a block boundary decodes to the same pixels as
/// without the padding that put it there (j_420.jpg, Pillow's pixels in the corpus).
#[test]
fn huffman_scans_and_skips_resume_across_pillows_blocks() {
    let (expected, _) = expected();
    let (_, want) = &expected["j_420.jpg"];
    let jpeg = std::fs::read(corpus().join("j_420.jpg")).unwrap();
    let sos = jpeg.windows(2).position(|w| w == [0xFF, 0xDA]).unwrap();
    let scan_across = with_comment(&jpeg, 65536 - 40 - sos);
    let skip_across = with_comment(&with_comment(&jpeg, 1000), 65000);
    for (what, bytes) in [("scan", scan_across), ("comment", skip_across)] {
        assert!(bytes.len() > 65536 + 100, "{what}");
        let got = decode_image_bytes(&bytes, Path::new(what)).unwrap();
        assert_eq!(got.as_raw(), want, "{what} across a 64 KiB block");
    }
}

fn reason(result: klein::Result<image::RgbImage>) -> String {
    match result {
        Err(KleinError::Image { reason, .. }) => reason,
        other => panic!("expected an image error, got {other:?}"),
    }
}

/// libjpeg's error exit becomes an error naming the file with libjpeg's message; no abort, no
/// panic, nothing printed. Damaged headers of each kind are refused the same way.
#[test]
fn broken_jpegs_are_refused_with_libjpegs_message() {
    let good = std::fs::read(corpus().join("j_420.jpg")).unwrap();
    let label = Path::new("broken.jpg");
    // DHT table class/id 0x55: libjpeg reads class 1 (0x10), index 0x45: "Bogus DHT index 69"
    let mut bad_dht = good.clone();
    let dht = bad_dht.windows(2).position(|w| w == [0xFF, 0xC4]).unwrap();
    bad_dht[dht + 4] = 0x55;
    let err = reason(decode_image_bytes(&bad_dht, label));
    assert!(err.contains("libjpeg: Bogus DHT index 69"), "{err}");

    // two components: Pillow opens 1, 3 or 4
    let mut two = good.clone();
    let sof = two.windows(2).position(|w| w == [0xFF, 0xC0]).unwrap();
    two[sof + 9] = 2;
    let err = reason(decode_image_bytes(&two, label));
    assert!(err.contains("2 colour components"), "{err}");

    // lossless (SOF3): Pillow's libjpeg-turbo 3 decodes it, the 2.1 decoder here cannot
    let mut lossless = good.clone();
    lossless[sof + 1] = 0xC3;
    let err = reason(decode_image_bytes(&lossless, label));
    assert!(err.contains("unsupported image (lossless JPEG)"), "{err}");

    // only the signature, cut inside the header, and random bytes after SOI
    for bytes in [
        &good[..3],
        &good[..200],
        &[0xFF, 0xD8, 0xFF, 0x12, 0x34][..],
    ] {
        let err = reason(decode_image_bytes(bytes, label));
        assert!(err.contains("cannot decode"), "{err}");
    }
}

/// Formats Pillow opens but klein does not decode exactly are refused with the list of those it
/// does.
#[test]
fn other_formats_are_refused_with_the_list() {
    for (bytes, name) in [
        (&b"GIF89a\x01\x00\x01\x00"[..], "GIF"),
        (&b"BM\x00\x00\x00\x00\x00\x00"[..], "BMP"),
        (&b"II*\x00\x08\x00\x00\x00"[..], "TIFF"),
        (&b"\x00\x00\x00\x1cftypavif"[..], "HEIF/AVIF"),
    ] {
        let err = reason(decode_image_bytes(bytes, Path::new("x")));
        assert!(
            err.contains(&format!("unsupported image ({name})"))
                && err.contains("klein decodes PNG, JPEG and WebP"),
            "{err}"
        );
    }
}
