//! The committed tiny bundle (`onnx/klein-tiny/`, written by klein-export) against the runtime:
//! its manifest, hashes, graph I/O contracts and metadata, its tokenizer, and one run of each graph
//! with the shapes of the contract (values are compared by the pipeline's tests, not here).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use klein::bundle::contract::check_graph;
use klein::bundle::manifest::Manifest;
use klein::pipeline::{Pipeline, PipelineOptions};
use klein::runtime::{self, Device, RuntimeOptions, SessionConfig};
use klein::stages::tokenize::PromptTokenizer;
use klein::KleinError;
use ndarray::{Array1, Array2, Array3, Array4};

use crate::util::{assert_mentions, init_runtime, ort_library, repo, temp_dir};

fn bundle_dir() -> PathBuf {
    repo().join("onnx/klein-tiny")
}

#[test]
fn tiny_bundle_satisfies_its_manifest() {
    let dir = bundle_dir();
    let manifest = Manifest::load(&dir).unwrap();
    manifest.verify_hashes(&dir).unwrap();

    init_runtime();
    let config = SessionConfig::default()
        .with_device(Device::Cpu)
        .with_intra_threads(1);
    for (component, spec) in manifest.graphs.iter() {
        let graph =
            runtime::load_graph(component.as_str(), &dir.join(&spec.file), &config, &[]).unwrap();
        check_graph(component, spec, &graph).unwrap();
    }

    let tokenizer =
        PromptTokenizer::load(&dir.join(&manifest.tokenizer.file), &manifest.tokenizer).unwrap();
    let encoded = tokenizer.encode("a photo of a cat").unwrap();
    assert_eq!(
        encoded.input_ids.len(),
        manifest.tokenizer.max_sequence_length
    );
}

#[test]
fn every_tiny_graph_runs_with_contract_shapes() {
    let dir = bundle_dir();
    let m = Manifest::load(&dir).unwrap();
    init_runtime();
    let config = SessionConfig::default()
        .with_device(Device::Cpu)
        .with_intra_threads(1);
    let load = |name: &'static str, file: &str| {
        runtime::load_graph(name, &dir.join(file), &config, &[]).unwrap()
    };
    let seq = m.tokenizer.max_sequence_length;
    let channels = m.latents.channels;
    let (lat_h, lat_w) = (2usize, 3usize);
    let (height, width) = (lat_h * 16, lat_w * 16);

    // text_encoder: [1, seq] ids and mask -> [1, seq, embed_dim]
    let mut text_encoder = load("text_encoder", &m.graphs.text_encoder.file);
    let encoded = PromptTokenizer::load(&dir.join(&m.tokenizer.file), &m.tokenizer)
        .unwrap()
        .encode("a cat")
        .unwrap();
    let ids = Array2::from_shape_vec((1, seq), encoded.input_ids).unwrap();
    let mask = Array2::from_shape_vec((1, seq), encoded.attention_mask).unwrap();
    let embeds = text_encoder
        .run(&[
            ("input_ids", ids.view().into()),
            ("attention_mask", mask.view().into()),
        ])
        .unwrap()
        .take("prompt_embeds")
        .unwrap();
    assert_eq!(embeds.shape(), [1, seq, m.text_encoder.embed_dim]);
    assert!(embeds.iter().all(|v| v.is_finite()));

    // transformer: [1, tokens, C] latents (+ ids) -> [1, tokens, C] velocity
    let tokens = lat_h * lat_w;
    let mut transformer = load("transformer", &m.graphs.transformer.file);
    let latents = Array3::<f32>::from_shape_fn((1, tokens, channels), |(_, t, c)| {
        ((t * 7 + c) % 11) as f32 / 11.0 - 0.5
    });
    let timestep = Array1::from_elem(1, 1.0f32);
    let img_ids = Array2::from_shape_fn((tokens, 4), |(t, axis)| match axis {
        1 => (t / lat_w) as i64,
        2 => (t % lat_w) as i64,
        _ => 0,
    });
    let txt_ids = Array2::from_shape_fn((seq, 4), |(l, axis)| if axis == 3 { l as i64 } else { 0 });
    let velocity = transformer
        .run(&[
            ("latents", latents.view().into()),
            ("prompt_embeds", embeds.view().into()),
            ("timestep", timestep.view().into()),
            ("img_ids", img_ids.view().into()),
            ("txt_ids", txt_ids.view().into()),
        ])
        .unwrap()
        .take("velocity")
        .unwrap();
    assert_eq!(velocity.shape(), [1, tokens, channels]);
    assert!(velocity.iter().all(|v| v.is_finite()));

    // vae_decoder: [1, C, lat_h, lat_w] -> [1, 3, H, W]; vae_encoder: back.
    let mut decoder = load("vae_decoder", &m.graphs.vae_decoder.file);
    let z = Array4::<f32>::from_shape_fn((1, channels, lat_h, lat_w), |(_, c, y, x)| {
        ((c + y * 3 + x) % 5) as f32 / 5.0
    });
    let image = decoder
        .run(&[("latents", z.view().into())])
        .unwrap()
        .take("image")
        .unwrap();
    assert_eq!(image.shape(), [1, 3, height, width]);
    let mut encoder = load("vae_encoder", &m.graphs.vae_encoder.file);
    let image = image.mapv(|v| v.clamp(-1.0, 1.0));
    let back = encoder
        .run(&[("image", image.view().into())])
        .unwrap()
        .take("latents")
        .unwrap();
    assert_eq!(back.shape(), [1, channels, lat_h, lat_w]);
}

/// `Pipeline::load` checks hashes by default, before any graph is loaded, and a stamp spares the
/// hashing of an unchanged bundle; a graph rewritten with garbage of the same size is refused at
/// load, stamp or not; `with_verify_hashes(false)` skips the check (the garbage then fails only
/// when the graph is loaded).
#[test]
fn pipeline_load_verifies_hashes_with_a_stamp() {
    let dir = temp_dir("bundle-verify");
    for entry in std::fs::read_dir(bundle_dir()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    let past = SystemTime::now() - Duration::from_secs(3600);
    for entry in std::fs::read_dir(&dir).unwrap() {
        let file = File::options()
            .write(true)
            .open(entry.unwrap().path())
            .unwrap();
        file.set_modified(past).unwrap();
    }
    let cache = temp_dir("bundle-verify-cache");
    let options = || {
        PipelineOptions::default()
            .with_device(Device::Cpu)
            .with_runtime(RuntimeOptions::default().with_library(ort_library()))
            .with_cache_dir(&cache)
    };
    let hashed = |pipeline: &Pipeline| pipeline.verification().map(|v| v.hashed);
    assert_eq!(
        hashed(&Pipeline::load(&dir, options()).unwrap()),
        Some(true)
    );
    assert_eq!(
        hashed(&Pipeline::load(&dir, options()).unwrap()),
        Some(false)
    );

    // Another file of the same size and time put in a file's place (as `rsync -a` or `tar x`
    // restore times): not the stamped file (another inode), so the bundle is hashed and refused.
    #[cfg(unix)]
    assert_a_replaced_file_is_hashed(&dir, options);

    // Garbage of the same size, written now.
    let graph = dir.join("transformer.onnx");
    let size = std::fs::metadata(&graph).unwrap().len() as usize;
    std::fs::write(&graph, vec![0x5a; size]).unwrap();
    match Pipeline::load(&dir, options()) {
        Err(KleinError::Bundle { reason, .. }) => assert_mentions(
            &reason,
            &["transformer.onnx: sha256 is", "manifest.json says"],
        ),
        Err(other) => panic!("expected a sha256 mismatch, got {other:?}"),
        Ok(_) => panic!("a tampered bundle was loaded"),
    }
    let mut unchecked = Pipeline::load(&dir, options().with_verify_hashes(false)).unwrap();
    assert!(unchecked.verification().is_none());
    match unchecked.load_all_graphs() {
        Err(KleinError::Bundle { path, .. }) => assert_eq!(path, graph),
        other => panic!("expected the loader to refuse transformer.onnx, got {other:?}"),
    }
}

/// After a stamp: a file of the stamped size and time put in a graph's place is refused.
#[cfg(unix)]
fn assert_a_replaced_file_is_hashed(dir: &Path, options: impl Fn() -> PipelineOptions) {
    let decoder = dir.join("vae_decoder.onnx");
    let stamped = std::fs::metadata(&decoder).unwrap();
    let replacement = dir.join("replacement");
    std::fs::write(&replacement, vec![0x5a; stamped.len() as usize]).unwrap();
    let file = File::options().write(true).open(&replacement).unwrap();
    file.set_modified(stamped.modified().unwrap()).unwrap();
    std::fs::rename(&replacement, &decoder).unwrap();
    match Pipeline::load(dir, options()) {
        Err(KleinError::Bundle { reason, .. }) => {
            assert_mentions(&reason, &["vae_decoder.onnx: sha256 is"])
        }
        Err(other) => panic!("expected a sha256 mismatch, got {other:?}"),
        Ok(_) => panic!("a replaced file passed for the stamped one"),
    }
    std::fs::copy(bundle_dir().join("vae_decoder.onnx"), &decoder).unwrap();
}
