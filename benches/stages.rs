//! Criterion benches of the pure-Rust stages (no ONNX Runtime): what klein adds around the graphs.
//!
//! - `noise/randn_1x128x64x64`: the seed's initial noise for a 1024x1024 image ([`klein::stages::noise::randn`]).
//! - `latents/pack_1x128x64x64`, `latents/unpack_1x4096x128`: `[B, C, h, w] <-> [B, h*w, C]`.
//! - `reference/preprocess_1536x1024`: a 1.5 MP RGB image through [`klein::stages::reference::preprocess_reference`]:
//!   the Lanczos resize to 1 MP (1254x836), the centre crop to multiples of 16, the float conversion.
//! - `output/encode_png_1024x1024`: [`klein::stages::output::encode_png`] of a 1024x1024 RGB image with the
//!   CLI's kind of text metadata.
//! - `preview/1x4096x128`: a step preview of a 1024x1024 image ([`klein::stages::preview::preview_image`]:
//!   128 x 3 multiply-adds per token, 4096 tokens, into a 128x128 RGB image).
//!
//! `cargo bench --bench stages` (add `-- --quick` for a short run; `-- reference` for one group).
//! The inputs are deterministic: a smooth pattern with xorshift noise, so that PNG compression and
//! the resize see photo-like data rather than a constant.
use std::hint::black_box;
use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion};
use image::DynamicImage;
use klein::stages::latents::{pack_latents, unpack_latents};
use klein::stages::noise::randn;
use klein::stages::output::{encode_png, RgbImage};
use klein::stages::preview::{preview_image, PreviewSpec};
use klein::stages::reference::{preprocess_reference, ReferenceLimits};
use ndarray::{Array3, Array4};

/// Latent grid of a 1024x1024 image: 1024 / 16.
const GRID: usize = 64;
const CHANNELS: usize = 128;
/// Pixels of the multiple that output and reference sizes are floored to (the manifest's
/// `latents.pixel_multiple`).
const PIXEL_MULTIPLE: u32 = 16;

/// `[h, w, 3]` RGB bytes: gradients plus a little xorshift noise (photo-like entropy for PNG).
fn test_pixels(width: u32, height: u32) -> Vec<u8> {
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let mut pixels = Vec::with_capacity(width as usize * height as usize * 3);
    for y in 0..height {
        for x in 0..width {
            for c in 0..3u32 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let smooth = (x * (c + 1) + y * (3 - c)) / 8 + (x ^ y) / 32;
                pixels.push((smooth as u64 + (state & 15)) as u8);
            }
        }
    }
    pixels
}

fn noise(c: &mut Criterion) {
    c.bench_function("noise/randn_1x128x64x64", |b| {
        b.iter(|| randn(black_box(42), black_box(&[1, CHANNELS, GRID, GRID])))
    });
}

fn latents(c: &mut Criterion) {
    let grid: Array4<f32> = randn(7, &[1, CHANNELS, GRID, GRID])
        .into_dimensionality()
        .expect("randn returns the shape it is given");
    let tokens: Array3<f32> = pack_latents(grid.view());
    c.bench_function("latents/pack_1x128x64x64", |b| {
        b.iter(|| pack_latents(black_box(grid.view())))
    });
    c.bench_function("latents/unpack_1x4096x128", |b| {
        b.iter(|| {
            unpack_latents(black_box(tokens.view()), GRID, GRID)
                .expect("4096 tokens form a 64x64 grid")
        })
    });
}

fn reference(c: &mut Criterion) {
    let (width, height) = (1536, 1024);
    let rgb = image::RgbImage::from_raw(width, height, test_pixels(width, height))
        .expect("the buffer holds width * height * 3 bytes");
    let image = DynamicImage::ImageRgb8(rgb);
    let limits = ReferenceLimits::default();
    let processed = preprocess_reference(&image, &limits, PIXEL_MULTIPLE, Path::new("bench.png"))
        .expect("a 1536x1024 RGB image is a valid reference");
    // 1536x1024 is over 1 MP: resized to int(1536 s) x int(1024 s), s = sqrt(2^20 / (1536*1024)),
    // = 1254x836, then cropped to 1248x832.
    assert_eq!(
        (processed.width, processed.height),
        (1248, 832),
        "the Lanczos path must run"
    );
    c.bench_function("reference/preprocess_1536x1024", |b| {
        b.iter(|| {
            preprocess_reference(
                black_box(&image),
                &limits,
                PIXEL_MULTIPLE,
                Path::new("bench.png"),
            )
            .expect("a valid reference")
        })
    });
}

fn output(c: &mut Criterion) {
    let (width, height) = (1024, 1024);
    let image = RgbImage {
        width,
        height,
        pixels: test_pixels(width, height),
    };
    // What the CLI writes (src/bin/klein/main.rs, png_text): prompt, seed, steps, guidance, size, model...
    let text: Vec<(String, String)> = [
        ("prompt", "a red fox in the snow, golden hour, photograph"),
        ("seed", "42"),
        ("steps", "4"),
        ("guidance", "1"),
        ("size", "1024x1024"),
        ("model", "klein-4b"),
        ("variant", "4b"),
        (
            "bundle_sha256",
            "0000000000000000000000000000000000000000000000000000000000000000",
        ),
        ("device", "cpu"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let encoded = encode_png(&image, &text).expect("encodes");
    println!("output/encode_png_1024x1024: {} bytes", encoded.len());
    c.bench_function("output/encode_png_1024x1024", |b| {
        b.iter(|| encode_png(black_box(&image), &text).expect("encodes"))
    });
}

fn preview(c: &mut Criterion) {
    let tokens = randn(7, &[GRID * GRID, CHANNELS])
        .into_dimensionality::<ndarray::Ix2>()
        .unwrap();
    let spec = PreviewSpec {
        weights: (0..CHANNELS)
            .map(|k| [k as f32 * 1e-3, -(k as f32) * 1e-3, 0.01])
            .collect(),
        bias: vec![[0.5; 3]; 4],
        fit_rmse: 0.0,
    };
    c.bench_function("preview/1x4096x128", |b| {
        b.iter(|| preview_image(black_box(tokens.view()), GRID, GRID, &spec))
    });
}

criterion_group!(stages, noise, latents, reference, output, preview);
criterion_main!(stages);
