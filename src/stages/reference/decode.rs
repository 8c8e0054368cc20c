//! From a file's bytes to the RGB8 image `diffusers.utils.load_image` gives: the header (format,
//! size, orientation) checked against [`crate::limits`] before any pixel is allocated, the format's
//! decoder with Pillow's conversion to RGB, then the EXIF orientation.
use image::RgbImage;

use super::container::{self, Container};
use super::header::{too_large, ImageFormat, ImageHeader};
use super::{jpeg, orientation, png, webp};
use crate::limits::{MAX_DECODE_BYTES, MAX_DECODE_SIDE};

/// The header of a file and the orientation Pillow applies, refused when over the limits.
pub(super) fn header(bytes: &[u8]) -> Result<(Container, ImageHeader), String> {
    if bytes.is_empty() {
        return Err("the file is empty".to_string());
    }
    let container = container::read(bytes)?;
    let (width, height) = (container.width, container.height);
    let decoded = u64::from(width) * u64::from(height) * container.bytes_per_pixel;
    if width > MAX_DECODE_SIDE || height > MAX_DECODE_SIDE || decoded > MAX_DECODE_BYTES {
        return Err(too_large(width, height));
    }
    let orientation = orientation::orientation(&container.metadata)?;
    let (width, height) = if orientation >= 5 {
        (height, width)
    } else {
        (width, height)
    };
    let header = ImageHeader {
        width,
        height,
        format: container.format,
        orientation,
    };
    Ok((container, header))
}

/// Decodes a whole file as `load_image` does.
pub(super) fn decode(bytes: &[u8]) -> Result<RgbImage, String> {
    let (container, header) = self::header(bytes)?;
    let rgb = match container.format {
        ImageFormat::Jpeg => jpeg::decode(bytes)?,
        ImageFormat::Png => png::decode(bytes)?,
        ImageFormat::WebP => webp::decode(bytes)?,
    };
    if rgb.dimensions() != (container.width, container.height) {
        return Err(format!(
            "cannot decode (the header says {}x{}, the image data {}x{})",
            container.width,
            container.height,
            rgb.width(),
            rgb.height()
        ));
    }
    Ok(orientation::transpose(rgb, header.orientation))
}
