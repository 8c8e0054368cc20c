//! LoRAs on the bundled tiny model: applied (the image moves, scale 0 is byte-equal to none,
//! removing them gives the plain image back), changed without reloading the text encoder, and
//! every mismatch refused with exit 2, the offending keys named and no output written. Parity with
//! diffusers for each format is in export/tests/test_lora.py.

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use klein::bundle::Manifest;
use klein::pipeline::{LoraSpec, Progress, Request, Stage};
use klein::stages::lora::{read_lora, LoraFamily, DIFFUSERS_LORA_FILE};
use klein::KleinError;
use safetensors::tensor::{Dtype, TensorView};

use crate::cli::{generate, klein};
use crate::util::{repo, temp_dir, tiny_pipeline};

/// `[out, in]` of every linear layer of the bundled model, from its LoRA map.
fn layers() -> BTreeMap<String, [usize; 2]> {
    let manifest = Manifest::load(&repo().join("onnx/klein-tiny")).unwrap();
    let targets = manifest.graphs.transformer.lora_targets.unwrap();
    targets.into_iter().map(|(m, t)| (m, t.shape)).collect()
}

/// Deterministic values in [-amplitude, amplitude).
fn values(n: usize, seed: u64, amplitude: f32) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amplitude
        })
        .collect()
}

/// A safetensors file of f32 tensors, with `metadata`.
fn write_file(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    metadata: Option<BTreeMap<String, String>>,
) {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(&str, TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), data)| {
            (
                name.as_str(),
                TensorView::new(Dtype::F32, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    let metadata = metadata.map(|m| m.into_iter().collect());
    safetensors::serialize_to_file(views, metadata, path).unwrap();
}

/// `dir/NAME.safetensors` holding `tensors` (name, shape; values seeded by the name), with
/// `metadata` as its `lora_adapter_metadata`.
fn lora_file(
    dir: &Path,
    name: &str,
    tensors: &[(&str, &[usize])],
    metadata: Option<&str>,
) -> PathBuf {
    let path = dir.join(format!("{name}.safetensors"));
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = tensors
        .iter()
        .map(|(key, shape)| {
            let seed = key
                .bytes()
                .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
            (
                key.to_string(),
                shape.to_vec(),
                values(shape.iter().product(), seed, 0.1),
            )
        })
        .collect();
    let metadata =
        metadata.map(|m| BTreeMap::from([("lora_adapter_metadata".to_string(), m.to_string())]));
    write_file(&path, &tensors, metadata);
    path
}

/// A diffusers-layout LoRA of rank 2 on every layer `keep` accepts, `[out, in]` scaled by `widen`.
fn diffusers_lora(path: &Path, keep: impl Fn(&str) -> bool, widen: usize) -> PathBuf {
    let mut tensors = Vec::new();
    for (i, (module, [out, inp])) in layers().into_iter().enumerate() {
        if !keep(&module) {
            continue;
        }
        let (out, inp) = (out * widen, inp * widen);
        tensors.push((
            format!("transformer.{module}.lora_A.weight"),
            vec![2, inp],
            values(2 * inp, i as u64, 0.3),
        ));
        tensors.push((
            format!("transformer.{module}.lora_B.weight"),
            vec![out, 2],
            values(2 * out, 100 + i as u64, 0.3),
        ));
    }
    write_file(path, &tensors, None);
    path.to_path_buf()
}

/// A rank-2 diffusers-layout LoRA on the first block's `to_q` whose factors all hold `value`.
fn to_q_filled_with(path: &Path, value: f32) -> PathBuf {
    let to_q = "transformer.transformer_blocks.0.attn.to_q";
    write_file(
        path,
        &[
            (
                format!("{to_q}.lora_A.weight"),
                vec![2, 64],
                vec![value; 128],
            ),
            (
                format!("{to_q}.lora_B.weight"),
                vec![64, 2],
                vec![value; 128],
            ),
        ],
        None,
    );
    path.to_path_buf()
}

fn request() -> Request {
    Request::new("a lighthouse at dusk")
        .with_seed(11)
        .with_size(64, 64)
        .with_steps(2)
}

/// Applying a LoRA moves the image; scale 0 gives the plain image byte for byte; setting no LoRA
/// again restores it. Changing LoRAs reloads the transformer and nothing else.
#[test]
fn lora_applies_and_changes_only_the_transformer() {
    let dir = temp_dir("lora-apply");
    let lora = diffusers_lora(&dir.join("all.safetensors"), |_| true, 1);
    let mut pipeline = tiny_pipeline();
    let plain = pipeline.generate(&request(), None).unwrap().images;

    pipeline.set_loras(&[LoraSpec::new(&lora, 0.0)]).unwrap();
    let zero = pipeline.generate(&request(), None).unwrap().images;
    assert_eq!(
        zero[0].pixels, plain[0].pixels,
        "scale 0 must be byte-equal to no LoRA"
    );

    let mut loads = Vec::new();
    let mut record = |event: Progress| {
        if let Progress::StageStarted(stage) = event {
            loads.push(stage);
        }
        ControlFlow::Continue(())
    };
    pipeline.set_loras(&[LoraSpec::new(&lora, 1.0)]).unwrap();
    let with = pipeline
        .generate(&request(), Some(&mut record))
        .unwrap()
        .images;
    let differing = with[0]
        .pixels
        .iter()
        .zip(&plain[0].pixels)
        .filter(|(a, b)| a != b)
        .count();
    assert!(
        differing > with[0].pixels.len() / 2,
        "the LoRA changed only {differing} of {} values",
        with[0].pixels.len()
    );
    assert!(loads.contains(&Stage::LoadTransformer), "{loads:?}");
    assert_eq!(pipeline.loras().len(), 1);
    assert_eq!(pipeline.loras()[0].modules.len(), layers().len());

    pipeline.set_loras(&[]).unwrap();
    let again = pipeline.generate(&request(), None).unwrap().images;
    assert_eq!(again[0].pixels, plain[0].pixels);
}

/// A directory is read as diffusers' `load_lora_weights` reads it: the file `save_lora_weights`
/// writes (`pytorch_lora_weights.safetensors`), else its only `.safetensors` file; with several
/// files and none of that name, or none at all, it is refused and its files named.
#[test]
fn a_lora_directory_gives_its_file() {
    let dir = temp_dir("lora-dir");
    let image = |pipeline: &mut klein::pipeline::Pipeline, path: &Path| {
        pipeline.set_loras(&[LoraSpec::new(path, 0.8)]).unwrap();
        pipeline.generate(&request(), None).unwrap().images[0]
            .pixels
            .clone()
    };
    let mut pipeline = tiny_pipeline();
    let saved = dir.join("saved");
    std::fs::create_dir_all(&saved).unwrap();
    let file = diffusers_lora(&saved.join(DIFFUSERS_LORA_FILE), |_| true, 1);
    diffusers_lora(&saved.join("notes.safetensors"), |_| false, 1); // passed over
    let want = image(&mut pipeline, &file);
    assert_eq!(image(&mut pipeline, &saved), want);

    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    diffusers_lora(&other.join("style.safetensors"), |_| true, 1);
    assert_eq!(image(&mut pipeline, &other), want);

    // A scale mistyped after a directory is named as such, as after a file.
    let mistyped = PathBuf::from(format!("{}:O.8", saved.display()));
    let error = read_lora(&mistyped, LoraFamily::Flux2)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("is a LoRA directory: \"O.8\" is not a scale; give DIR:SCALE"),
        "{error}"
    );

    diffusers_lora(&other.join("second.safetensors"), |_| true, 1);
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    for (path, reason) in [
        (
            &other,
            "several .safetensors files (second.safetensors, style.safetensors)",
        ),
        (
            &empty,
            "a directory without pytorch_lora_weights.safetensors",
        ),
    ] {
        let error = pipeline.set_loras(&[LoraSpec::new(path, 1.0)]).unwrap_err();
        assert!(error.is_user_error(), "{error}");
        let message = error.to_string();
        assert!(
            message.contains(&path.display().to_string()) && message.contains(reason),
            "{message}"
        );
    }
}

/// With the text encoder kept loaded, a LoRA change reloads the transformer only.
#[test]
fn set_loras_keeps_the_text_encoder() {
    let dir = temp_dir("lora-keep");
    let lora = diffusers_lora(&dir.join("all.safetensors"), |_| true, 1);
    let options = klein::pipeline::PipelineOptions::default()
        .with_device(klein::runtime::Device::Cpu)
        .with_threads(1)
        .with_keep_text_encoder(true)
        .with_runtime(
            klein::runtime::RuntimeOptions::default().with_library(crate::util::ort_library()),
        )
        .with_cache_dir(crate::util::test_cache_dir());
    let mut pipeline =
        klein::pipeline::Pipeline::load(&repo().join("onnx/klein-tiny"), options).unwrap();
    pipeline.generate(&request(), None).unwrap();
    let mut stages = Vec::new();
    let mut record = |event: Progress| {
        if let Progress::StageStarted(stage) = event {
            stages.push(stage);
        }
        ControlFlow::Continue(())
    };
    pipeline.set_loras(&[LoraSpec::new(&lora, 0.5)]).unwrap();
    pipeline
        .generate(&request().with_seed(12), Some(&mut record))
        .unwrap();
    assert!(stages.contains(&Stage::LoadTransformer), "{stages:?}");
    assert!(!stages.contains(&Stage::LoadTextEncoder), "{stages:?}");
    assert!(!stages.contains(&Stage::LoadVaeDecoder), "{stages:?}");
}

/// A refused LoRA leaves the pipeline's LoRAs as they were.
#[test]
fn a_refused_lora_keeps_the_previous_ones() {
    let dir = temp_dir("lora-keep-previous");
    let good = diffusers_lora(&dir.join("good.safetensors"), |_| true, 1);
    let wide = diffusers_lora(&dir.join("wide.safetensors"), |_| true, 2);
    let mut pipeline = tiny_pipeline();
    pipeline.set_loras(&[LoraSpec::new(&good, 1.0)]).unwrap();
    let error = pipeline
        .set_loras(&[LoraSpec::new(&wide, 1.0)])
        .unwrap_err();
    assert!(matches!(error, KleinError::Lora { .. }), "{error:?}");
    assert_eq!(pipeline.loras()[0].path, good);
}

/// Each mismatch: exit 2, the reason and the first offending keys named, no output file.
#[test]
fn mismatched_loras_are_refused() {
    let dir = temp_dir("lora-refused");
    let some = |m: &str| m.starts_with("transformer_blocks.0.");
    let wide = diffusers_lora(&dir.join("9b.safetensors"), some, 2);
    // FLUX.1's diffusers names (norm1.linear, proj_mlp) are no klein layers.
    let flux1 = lora_file(
        &dir,
        "flux1",
        &[
            (
                "transformer.single_transformer_blocks.0.proj_mlp.lora_A.weight",
                &[2, 64],
            ),
            (
                "transformer.single_transformer_blocks.0.proj_mlp.lora_B.weight",
                &[256, 2],
            ),
        ],
        None,
    );
    let x_embedder = [
        ("transformer.x_embedder.lora_A.weight", &[2, 128][..]),
        ("transformer.x_embedder.lora_B.weight", &[64, 2][..]),
    ];
    let text = lora_file(
        &dir,
        "text_encoder",
        &[
            x_embedder[0],
            x_embedder[1],
            ("text_encoder.layers.0.q_proj.lora_A.weight", &[2, 16]),
            ("text_encoder.layers.0.q_proj.lora_B.weight", &[16, 2]),
        ],
        None,
    );
    let kohya = lora_file(
        &dir,
        "kohya",
        &[
            ("lora_unet_img_in.lora_down.weight", &[2, 128]),
            ("lora_unet_img_in.lora_up.weight", &[64, 2]),
            (
                "lora_unet_double_blocks_0_img_mod_lin.lora_down.weight",
                &[2, 64],
            ),
            (
                "lora_unet_double_blocks_0_img_mod_lin.lora_up.weight",
                &[384, 2],
            ),
        ],
        None,
    );
    let rank = lora_file(
        &dir,
        "rank",
        &[
            x_embedder[0],
            ("transformer.x_embedder.lora_B.weight", &[64, 3]),
        ],
        None,
    );
    let half = lora_file(&dir, "half", &x_embedder[..1], None);
    let dora = lora_file(
        &dir,
        "dora",
        &[
            x_embedder[0],
            x_embedder[1],
            ("transformer.x_embedder.lora_magnitude_vector", &[64, 1]),
        ],
        None,
    );
    let metadata = r#"{"transformer.r": 8, "transformer.lora_alpha": 8}"#;
    let metadata_rank = lora_file(&dir, "metadata", &x_embedder, Some(metadata));
    let not_safetensors = dir.join("model.ckpt");
    std::fs::write(&not_safetensors, b"PK\x03\x04 a pickle").unwrap();

    let one_wide = lora_file(
        &dir,
        "one_wide",
        &[
            (
                "transformer.transformer_blocks.0.attn.add_k_proj.lora_A.weight",
                &[2, 128],
            ),
            (
                "transformer.transformer_blocks.0.attn.add_k_proj.lora_B.weight",
                &[128, 2],
            ),
        ],
        None,
    );
    // Finite factors whose product, or whose alpha, is past float32: merged, the weight would be
    // infinite (a black image with exit 0 before this was checked). Refused when set, from the
    // factors' bound.
    let huge = to_q_filled_with(&dir.join("huge.safetensors"), 1e20);
    let alpha = r#"{"transformer.r": 2, "transformer.lora_alpha": 1e300}"#;
    let huge_alpha = lora_file(&dir, "huge_alpha", &x_embedder, Some(alpha));
    let cases: Vec<(PathBuf, Vec<&str>)> = vec![
        (
            huge,
            vec![
                "huge.safetensors",
                "changes transformer_blocks.0.attn.to_q by up to 1.00e40",
                "float32 weights cannot hold",
                "lower the LoRA's scale",
            ],
        ),
        (
            huge_alpha,
            vec![
                "huge_alpha.safetensors",
                "changes x_embedder",
                "cannot hold",
            ],
        ),
        (
            one_wide,
            vec!["1 layer does not have the shape", "add_k_proj"],
        ),
        (
            wide,
            vec![
                "shape",
                "transformer_blocks.0.attn.add_k_proj is [64, 64]",
                "[128, 128]",
                "another size",
            ],
        ),
        (
            flux1,
            vec![
                "single_transformer_blocks.0.proj_mlp",
                "not linear layers",
                "another model",
            ],
        ),
        (
            text,
            vec![
                "text-encoder keys",
                "text_encoder.layers.0.q_proj.lora_A.weight",
                "transformer only",
            ],
        ),
        (
            kohya,
            vec![
                "lora_unet_double_blocks_0_img_mod_lin.lora_down.weight",
                "kohya",
                "match no layer",
            ],
        ),
        (rank, vec!["rank", "x_embedder"]),
        (half, vec!["only one of lora_A and lora_B"]),
        (dora, vec!["DoRA", "lora_magnitude_vector"]),
        (metadata_rank, vec!["rank 2", "metadata says 8"]),
        (not_safetensors, vec!["not a safetensors file"]),
        (dir.join("missing.safetensors"), vec!["missing.safetensors"]),
    ];
    for (lora, needles) in cases {
        let out = dir.join("out.png");
        let arg = format!("{}:0.5", lora.display());
        let run = generate(
            "a fox",
            &out,
            &[
                "--lora", &arg, "--width", "64", "--height", "64", "--steps", "1", "--seed", "1",
            ],
        );
        run.assert_user_error(&needles);
        assert!(!out.exists(), "{} left an output", lora.display());
    }
}

/// Bounds on the scale and the count are checked before any file is read; a scale that is no
/// number is named as such.
#[test]
fn scale_and_count_bounds() {
    let dir = temp_dir("lora-bounds");
    let out = dir.join("out.png");
    generate("a fox", &out, &["--lora", "/no/such.safetensors:1e9"])
        .assert_user_error(&["scale", "between -100 and 100"]);
    let many: Vec<String> = (0..17)
        .flat_map(|i| ["--lora".to_string(), format!("/no/{i}.safetensors")])
        .collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    generate("a fox", &out, &many).assert_user_error(&["17 LoRAs", "at most 16"]);
    // A scale that is no number (O for 0) reads as part of the file name; where the file before
    // the colon exists, the message says so.
    let file = dir.join("style.safetensors");
    std::fs::write(&file, b"").unwrap();
    let arg = format!("{}:O.8", file.display());
    generate("a fox", &out, &["--lora", &arg])
        .assert_user_error(&["\"O.8\" is not a scale", &format!("{}:0.8", file.display())]);
    assert!(!out.exists());
}

/// A bundle without a LoRA map (exported before), or quantized, is refused with the way that works.
#[test]
fn bundles_that_cannot_take_a_lora_say_what_can() {
    let dir = temp_dir("lora-bundles");
    let lora = diffusers_lora(&dir.join("all.safetensors"), |_| true, 1);
    for (name, edit) in [
        ("old", "remove the map"),
        ("quantized", "mark the transformer quantized"),
    ] {
        let bundle = dir.join(name);
        std::fs::create_dir_all(&bundle).unwrap();
        for entry in std::fs::read_dir(repo().join("onnx/klein-tiny")).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), bundle.join(entry.file_name())).unwrap();
        }
        let path = bundle.join("manifest.json");
        let mut manifest: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let transformer = &mut manifest["graphs"]["transformer"];
        match edit {
            "remove the map" => {
                transformer.as_object_mut().unwrap().remove("lora_targets");
            }
            _ => {
                transformer["quantization"] = serde_json::json!({
                    "method": "MatMulNBits", "bits": 8, "block_size": 32, "symmetric": true,
                    "accuracy_level": 0
                });
            }
        }
        std::fs::write(&path, serde_json::to_vec_pretty(&manifest).unwrap()).unwrap();
        let run = klein([
            "info".as_ref(),
            bundle.as_os_str(),
            "--lora".as_ref(),
            lora.as_os_str(),
        ]);
        let needles: &[&str] = match edit {
            "remove the map" => &["no LoRA map", "klein-export lora-map"],
            // The export command to run instead makes the same kind of bundle: int8, not fp32.
            _ => &[
                "quantized (8 bits)",
                "klein-export convert",
                ":SCALE --quantize int8 ...",
            ],
        };
        run.assert_user_error(needles);
    }
}

/// `klein info --lora` lists what would be applied, without generating.
#[test]
fn info_lists_the_layers_a_lora_changes() {
    let dir = temp_dir("lora-info");
    let lora = diffusers_lora(
        &dir.join("blocks.safetensors"),
        |m| m.starts_with("transformer_blocks.1."),
        1,
    );
    let arg = format!("{}:0.8", lora.display());
    let run = klein(["info", "--lora", &arg]);
    assert_eq!(run.code, Some(0), "{}", run.describe());
    crate::util::assert_mentions(
        &run.stdout,
        &[
            "LoRA map:     37 linear layers",
            "diffusers/PEFT LoRA, scale 0.8): 12 layers",
            "transformer_blocks.1.attn.to_q",
            "[64, 64]",
            "rank 2",
        ],
    );
}

/// Batch lines choose their LoRAs (relative to the file); a line without `loras` takes `--lora`;
/// a line whose LoRA cannot be used fails alone, with exit 2 at the end.
#[test]
fn batch_lines_choose_their_loras() {
    let dir = temp_dir("lora-batch");
    diffusers_lora(&dir.join("style.safetensors"), |_| true, 1);
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        concat!(
            r#"{"prompt": "a fox", "seed": 3, "loras": ["style.safetensors:0"], "name": "zero"}"#,
            "\n",
            r#"{"prompt": "a fox", "seed": 3, "name": "flag"}"#,
            "\n",
            r#"{"prompt": "a fox", "seed": 3, "loras": [], "name": "none"}"#,
            "\n",
            r#"{"prompt": "a fox", "seed": 3, "loras": ["missing.safetensors"], "name": "bad"}"#,
            "\n",
        ),
    )
    .unwrap();
    let out = dir.join("out");
    let flag = format!("{}:1", dir.join("style.safetensors").display());
    let run = klein([
        "generate",
        "--prompts",
        prompts.to_str().unwrap(),
        "--out-dir",
        out.to_str().unwrap(),
        "--width",
        "64",
        "--height",
        "64",
        "--steps",
        "2",
        "--lora",
        &flag,
    ]);
    assert_eq!(run.code, Some(2), "{}", run.describe());
    crate::util::assert_mentions(&run.stderr, &["line 4 (bad)", "missing.safetensors"]);
    let pixels = |name: &str| {
        image::open(out.join(format!("{name}.png")))
            .unwrap()
            .to_rgb8()
            .into_raw()
    };
    assert_eq!(pixels("zero"), pixels("none"), "scale 0 equals no LoRA");
    assert_ne!(
        pixels("flag"),
        pixels("none"),
        "the --lora LoRA applies to lines without loras"
    );
    assert!(!out.join("bad.png").exists());
}

/// `klein_set_loras`: the C API's image with a LoRA equals the Rust API's; a refused LoRA is
/// KLEIN_ERROR_USER with the reason; NULL arrays with a count are invalid arguments; count 0
/// removes the LoRAs.
#[test]
fn c_api_sets_loras() {
    use crate::capi::{c_paths, call, cpu_options, generate_into};
    use klein::capi::{klein_pipeline_free, klein_set_loras, KleinRequest, KleinStatus::*};
    use std::ffi::CString;
    use std::ptr;

    let dir = temp_dir("lora-capi");
    let lora = diffusers_lora(&dir.join("all.safetensors"), |_| true, 1);
    let wide = diffusers_lora(&dir.join("wide.safetensors"), |_| true, 2);
    let (bundle, library) = c_paths();
    let options = cpu_options(&library, 1);
    let pipeline = crate::capi::load(&bundle, &options);
    // SAFETY (every call): valid pointers, NUL-terminated strings, a live pipeline.
    let c_request = KleinRequest {
        prompt: c"a lighthouse at dusk".as_ptr(),
        seed: 11,
        width: 64,
        height: 64,
        steps: 2,
        guidance: 0.0,
        num_images: 1,
        reference_paths: ptr::null(),
        reference_count: 0,
        negative_prompt: std::ptr::null(),
        image_path: std::ptr::null(),
        mask_path: std::ptr::null(),
        strength: 0.0,
        preview_every: 0,
        preview: None,
        preview_user_data: std::ptr::null_mut(),
        mask_crop: 0,
        mask_crop_padding: 0,
    };
    let path = CString::new(lora.to_str().unwrap()).unwrap();
    let paths = [path.as_ptr()];
    let scales = [0.7f32];
    let (status, message) =
        call(|m| unsafe { klein_set_loras(pipeline, paths.as_ptr(), scales.as_ptr(), 1, m) });
    assert_eq!((status, message.as_str()), (KLEIN_OK, ""));
    let mut rgba = vec![0u8; 64 * 64 * 4];
    let (status, message) = call(|m| unsafe { generate_into(pipeline, &c_request, &mut rgba, m) });
    assert_eq!((status, message.as_str()), (KLEIN_OK, ""));
    let mut rust = tiny_pipeline();
    rust.set_loras(&[LoraSpec::new(&lora, 0.7)]).unwrap();
    let want = rust.generate(&request(), None).unwrap().images[0]
        .pixels
        .clone();
    let rgb: Vec<u8> = rgba.chunks_exact(4).flat_map(|p| p[..3].to_vec()).collect();
    assert_eq!(rgb, want);

    let wide_path = CString::new(wide.to_str().unwrap()).unwrap();
    let wide_paths = [wide_path.as_ptr()];
    let (status, message) =
        call(|m| unsafe { klein_set_loras(pipeline, wide_paths.as_ptr(), scales.as_ptr(), 1, m) });
    assert_eq!(status, KLEIN_ERROR_USER, "{message}");
    crate::util::assert_mentions(&message, &["wide.safetensors", "another size"]);
    let (status, message) =
        call(|m| unsafe { klein_set_loras(pipeline, ptr::null(), scales.as_ptr(), 1, m) });
    assert_eq!(status, KLEIN_ERROR_INVALID_ARGUMENT, "{message}");
    let (status, message) =
        call(|m| unsafe { klein_set_loras(pipeline, ptr::null(), ptr::null(), 0, m) });
    assert_eq!((status, message.as_str()), (KLEIN_OK, ""));
    let (status, _) = call(|m| unsafe { generate_into(pipeline, &c_request, &mut rgba, m) });
    assert_eq!(status, KLEIN_OK);
    let plain = tiny_pipeline().generate(&request(), None).unwrap().images[0]
        .pixels
        .clone();
    let rgb: Vec<u8> = rgba.chunks_exact(4).flat_map(|p| p[..3].to_vec()).collect();
    assert_eq!(rgb, plain, "count 0 removes the LoRAs");
    unsafe { klein_pipeline_free(pipeline) };
}

/// A LoRA whose merged weights fit float32 but whose products overflow in the transformer: the
/// image is written (as diffusers would), and the run says its latents are not finite rather than
/// passing a black image off as a result.
#[test]
fn latents_that_overflow_are_reported() {
    let dir = temp_dir("lora-overflow-warning");
    // Each merged value 2 x 8.9e18 x 8.9e18 = 1.58e38: within float32 and the set-time bound.
    let big = to_q_filled_with(&dir.join("big.safetensors"), 8.9e18);
    let out = dir.join("out.png");
    let lora = big.display().to_string();
    let run = generate(
        "a fox",
        &out,
        &[
            "--lora", &lora, "--width", "64", "--height", "64", "--steps", "1", "--seed", "1",
        ],
    );
    run.assert_success(&[&out]);
    assert!(
        run.stderr
            .contains("2048 of 2048 denoised latent values are not finite"),
        "{}",
        run.describe()
    );
}

/// LoRAs each within the set-time bound whose sum on one layer is past float32: refused when the
/// weights are merged (at the transformer's load), exit 2, the layer and the files named, no output.
#[test]
fn merged_sums_past_the_weights_precision_are_refused() {
    let dir = temp_dir("lora-merged-sum");
    let files: Vec<String> = ["a", "b", "c"]
        .iter()
        .map(|n| {
            let path = to_q_filled_with(&dir.join(format!("{n}.safetensors")), 8.9e18);
            path.display().to_string()
        })
        .collect();
    let out = dir.join("out.png");
    let mut args = vec![
        "--width", "64", "--height", "64", "--steps", "1", "--seed", "1",
    ];
    for file in &files {
        args.extend(["--lora", file.as_str()]);
    }
    let run = generate("a fox", &out, &args);
    run.assert_user_error(&[
        "a.safetensors: merged into transformer_blocks.0.attn.to_q",
        "with ",
        "b.safetensors",
        "c.safetensors",
        "float32 weights cannot hold",
    ]);
    assert!(!out.exists(), "{}", run.describe());
}
