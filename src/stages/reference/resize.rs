//! `Image.resize(size, LANCZOS)` (and `BICUBIC`, Pillow's default filter) of Pillow on an RGB8
//! image (`libImaging/Resample.c`), bit for bit: the filter taps in f64, normalised to 22-bit fixed
//! point, the horizontal pass over the rows the vertical pass needs, then the vertical pass.
use std::borrow::Cow;
use std::f64::consts::PI;

use image::RgbImage;

/// Pillow's LANCZOS filter support (`Resample.c`): a 3-lobe windowed sinc.
const LANCZOS_SUPPORT: f64 = 3.0;
/// `PRECISION_BITS` of `Resample.c`: 8 bits for the result, 2 for overshoot, in an int32.
const PRECISION_BITS: u32 = 32 - 8 - 2;

fn sinc(x: f64) -> f64 {
    if x == 0.0 {
        return 1.0;
    }
    let x = x * PI;
    x.sin() / x
}

fn lanczos(x: f64) -> f64 {
    if (-LANCZOS_SUPPORT..LANCZOS_SUPPORT).contains(&x) {
        sinc(x) * sinc(x / LANCZOS_SUPPORT)
    } else {
        0.0
    }
}

/// Pillow's BICUBIC filter (`bicubic_filter`, a = -0.5), support 2.
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// A resampling filter of `Resample.c`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Filter {
    Lanczos,
    Bicubic,
}

impl Filter {
    fn support(self) -> f64 {
        match self {
            Filter::Lanczos => LANCZOS_SUPPORT,
            Filter::Bicubic => 2.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        match self {
            Filter::Lanczos => lanczos(x),
            Filter::Bicubic => bicubic(x),
        }
    }
}

/// The filter taps of one axis (`precompute_coeffs` + `normalize_coeffs_8bpc` of `Resample.c`):
/// output pixel `i` reads `count[i]` input pixels from `first[i]` with fixed-point `weights`.
struct Taps {
    /// Weights per output pixel (`ksize` of `Resample.c`); unused tail entries are 0.
    stride: usize,
    first: Vec<usize>,
    count: Vec<usize>,
    weights: Vec<i32>,
}

impl Taps {
    /// For the input span `in0..in1` (`box` of `Image.resize`; the whole axis without one).
    /// A span of zero length samples the filter around one edge, as Pillow does.
    fn new(filter: Filter, in_size: u32, in0: f64, in1: f64, out_size: u32) -> Self {
        // `in1 - in0` is computed in float in Pillow; exact for image sizes.
        let scale = (in1 - in0) / f64::from(out_size);
        let filter_scale = scale.max(1.0);
        let support = filter.support() * filter_scale;
        let stride = support.ceil() as usize * 2 + 1;
        let out_size = out_size as usize;
        let mut taps = Taps {
            stride,
            first: Vec::with_capacity(out_size),
            count: Vec::with_capacity(out_size),
            weights: vec![0; out_size * stride],
        };
        let mut k = vec![0.0f64; stride];
        for xx in 0..out_size {
            let center = in0 + (xx as f64 + 0.5) * scale;
            let ss = 1.0 / filter_scale;
            // C `(int)` truncates toward zero, as `as` does.
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xmax = ((center + support + 0.5) as i64).min(i64::from(in_size)) - xmin;
            let count = xmax.max(0) as usize;
            let mut total = 0.0;
            for (x, w) in k.iter_mut().enumerate().take(count) {
                *w = filter.weight(((x as i64 + xmin) as f64 - center + 0.5) * ss);
                total += *w;
            }
            let row = &mut taps.weights[xx * stride..(xx + 1) * stride];
            for (w, fixed) in k.iter().take(count).zip(row.iter_mut()) {
                let w = if total != 0.0 { w / total } else { *w };
                let scaled = w * f64::from(1u32 << PRECISION_BITS);
                *fixed = if w < 0.0 {
                    (-0.5 + scaled) as i32
                } else {
                    (0.5 + scaled) as i32
                };
            }
            taps.first.push(xmin as usize);
            taps.count.push(count);
        }
        taps
    }

    /// `clip8(sum)` over the taps of output `i`, reading input samples through `sample(j)`.
    fn apply(&self, i: usize, sample: impl Fn(usize) -> u8) -> u8 {
        let weights = &self.weights[i * self.stride..i * self.stride + self.count[i]];
        let mut sum: i64 = 1 << (PRECISION_BITS - 1);
        for (j, &w) in weights.iter().enumerate() {
            sum += i64::from(sample(self.first[i] + j)) * i64::from(w);
        }
        (sum >> PRECISION_BITS).clamp(0, 255) as u8
    }
}

/// `Image.resize((width, height), LANCZOS)` on an RGB image: Pillow's `ImagingResample`, horizontal
/// pass over the rows the vertical pass needs, then vertical pass, in 8-bit fixed point.
pub(super) fn resize_lanczos(src: &RgbImage, width: u32, height: u32) -> RgbImage {
    let (in_w, in_h) = src.dimensions();
    resize_box(src, Filter::Lanczos, width, height, [0, 0, in_w, in_h])
}

/// `Image.resize((width, height), filter, box=(left, top, right, bottom))`: the box's span of
/// the source (possibly of zero width or height) resampled to `width` x `height`.
pub(super) fn resize_box(
    src: &RgbImage,
    filter: Filter,
    width: u32,
    height: u32,
    bounds: [u32; 4],
) -> RgbImage {
    let (in_w, in_h) = src.dimensions();
    let [left, top, right, bottom] = bounds.map(f64::from);
    // `ImagingResampleInner`: a pass runs when its size or its span changes.
    let need_horizontal = width != in_w || bounds[0] != 0 || bounds[2] != width;
    let need_vertical = height != in_h || bounds[1] != 0 || bounds[3] != height;
    let vertical = Taps::new(filter, in_h, top, bottom, height);
    let horizontal = need_horizontal.then(|| Taps::new(filter, in_w, left, right, width));
    // Rows of the source the vertical pass reads.
    let first_row = vertical.first.first().copied().unwrap_or(0);
    let last_row = match (vertical.first.last(), vertical.count.last()) {
        (Some(first), Some(count)) => first + count,
        _ => 0,
    };
    // [in_h, in_w, 3] -> [last_row - first_row, width, 3] (or the source when the width is kept)
    let temp = match &horizontal {
        Some(taps) => Cow::Owned(RgbImage::from_fn(
            width,
            (last_row - first_row) as u32,
            |x, y| {
                let row = first_row as u32 + y;
                image::Rgb(std::array::from_fn(|c| {
                    taps.apply(x as usize, |j| src.get_pixel(j as u32, row)[c])
                }))
            },
        )),
        None => Cow::Borrowed(src),
    };
    if !need_vertical {
        return temp.into_owned();
    }
    // Rows of `temp` are counted from `first_row` when the horizontal pass made it.
    let row_offset = if horizontal.is_some() { first_row } else { 0 };
    // [rows, width, 3] -> [height, width, 3]
    RgbImage::from_fn(width, height, |x, y| {
        image::Rgb(std::array::from_fn(|c| {
            vertical.apply(y as usize, |j| {
                temp.get_pixel(x, (j - row_offset) as u32)[c]
            })
        }))
    })
}
