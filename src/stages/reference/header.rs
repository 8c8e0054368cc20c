//! What [`super::read_header`] returns: a reference file's format and size, read from its header.
use crate::limits::{MAX_DECODE_BYTES, MAX_DECODE_SIDE};

/// The formats klein decodes, each exactly as Pillow decodes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ImageFormat {
    Png,
    Jpeg,
    WebP,
}

impl ImageFormat {
    /// The formats, for messages.
    pub const LIST: &'static str = "PNG, JPEG and WebP";
    pub const ANY: &'static str = "PNG, JPEG or WebP";

    /// The format of a file from its first bytes, with Pillow's signatures (`_accept` of
    /// `PngImagePlugin`, `JpegImagePlugin`, `WebPImagePlugin`).
    pub fn sniff(bytes: &[u8]) -> Option<Self> {
        if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
            Some(Self::Png)
        } else if bytes.starts_with(b"\xff\xd8\xff") {
            Some(Self::Jpeg)
        } else if bytes.starts_with(b"RIFF")
            && bytes.get(8..12) == Some(b"WEBP")
            && matches!(bytes.get(12..16), Some(b"VP8 " | b"VP8L" | b"VP8X"))
        {
            Some(Self::WebP)
        } else {
            None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Png => "PNG",
            Self::Jpeg => "JPEG",
            Self::WebP => "WebP",
        }
    }
}

/// A reference file's header: enough to check sizes and token budgets before decoding pixels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageHeader {
    /// Width of the decoded image after EXIF orientation: the width of
    /// `diffusers.utils.load_image(path)` (the stored height for orientations 5 to 8).
    pub width: u32,
    /// Height after EXIF orientation.
    pub height: u32,
    pub format: ImageFormat,
    /// The EXIF orientation Pillow applies (`ImageOps.exif_transpose`), 1 to 8; 1 when there is
    /// none or Pillow ignores it.
    pub orientation: u8,
}

/// The refusal for an image over [`MAX_DECODE_SIDE`] or [`MAX_DECODE_BYTES`].
pub(super) fn too_large(width: u32, height: u32) -> String {
    format!(
        "the image ({width}x{height}) is larger than this runtime decodes (at most \
         {MAX_DECODE_SIDE} px per side and {} MiB of pixels); downscale it first",
        MAX_DECODE_BYTES / (1024 * 1024)
    )
}
