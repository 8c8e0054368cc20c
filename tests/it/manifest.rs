//! `manifest.json` loading and bundle checks, on bundles built in a temporary folder from
//! `tests/fixtures/bundle_manifest.json` (the README's example with FLUX.2-klein-4B numbers).

use std::path::{Path, PathBuf};

use klein::bundle::manifest::{DimSpec, Manifest, ModelVariant, Precision};
use klein::bundle::Verification;
use klein::runtime::Dtype;
use klein::stages::schedule::TimeShiftType;
use klein::stages::tokenize::PaddingSide;
use klein::KleinError;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::util::{assert_mentions, backdate, fixture, temp_dir};

/// Contents of the bundle's files; only sizes and hashes matter to the manifest.
const FILES: &[(&str, &[u8])] = &[
    ("tokenizer.json", b"{\"placeholder\": true}"),
    ("text_encoder.onnx", b"text encoder bytes"),
    ("transformer.onnx", b"transformer bytes"),
    (
        "transformer.onnx.data",
        b"external weights of the transformer",
    ),
    ("vae_encoder.onnx", b"vae encoder bytes"),
    ("vae_decoder.onnx", b"vae decoder bytes"),
];

fn template() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("bundle_manifest.json")).unwrap())
        .unwrap()
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes FILES and a manifest listing them into a fresh folder, after `edit` changes the manifest.
fn bundle(name: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let dir = temp_dir(name);
    let mut manifest = template();
    for (file, bytes) in FILES {
        std::fs::write(dir.join(file), bytes).unwrap();
        manifest["files"][file] = json!({"bytes": bytes.len(), "sha256": sha256_hex(bytes)});
    }
    edit(&mut manifest);
    write_manifest(&dir, &serde_json::to_string_pretty(&manifest).unwrap());
    dir
}

fn write_manifest(dir: &Path, text: &str) {
    std::fs::write(dir.join("manifest.json"), text).unwrap();
}

/// The error of loading `dir`: the path it names and its reason.
fn load_error(dir: &Path) -> (PathBuf, String) {
    match Manifest::load(dir) {
        Err(KleinError::Bundle { path, reason }) => (path, reason),
        other => panic!("expected a bundle error, got {other:?}"),
    }
}

#[test]
fn a_valid_bundle_loads_with_every_field() {
    let dir = bundle("valid", |_| {});
    let m = Manifest::load(&dir).unwrap();
    assert_eq!(m.format_version, 1);
    assert_eq!(m.model.variant, ModelVariant::Klein4B);
    assert_eq!(m.model.default_steps, 4);
    assert_eq!(m.tokenizer.pad_token_id, 151643);
    assert_eq!(m.tokenizer.padding_side, PaddingSide::Right);
    assert_eq!(m.tokenizer.max_sequence_length, 512);
    assert_eq!(m.text_encoder.hidden_layers, [9, 18, 27]);
    assert_eq!(m.transformer.rope_theta, 2000.0);
    assert_eq!(m.vae.batch_norm_eps, 1e-4);
    assert_eq!(m.references.time_offset_scale, 10);
    assert_eq!(m.scheduler.class_name, "FlowMatchEulerDiscreteScheduler");
    assert_eq!(
        m.scheduler.shift.time_shift_type,
        TimeShiftType::Exponential
    );
    assert_eq!(m.scheduler.empirical_mu.a1, 8.73809524e-05);
    assert_eq!(m.scheduler.empirical_mu.seq_len_threshold, 4300);

    let names: Vec<&str> = m.graphs.iter().map(|(c, _)| c.as_str()).collect();
    assert_eq!(
        names,
        ["text_encoder", "transformer", "vae_encoder", "vae_decoder"]
    );
    let tr = &m.graphs.transformer;
    assert_eq!(tr.precision, Precision::Fp16);
    assert_eq!(m.graphs.vae_decoder.precision, Precision::Bf16);
    assert_eq!(tr.inputs[3].name, "img_ids");
    assert_eq!(tr.inputs[3].dtype, Dtype::Int64);
    assert_eq!(
        tr.inputs[3].shape,
        [DimSpec::Named("tokens".into()), DimSpec::Fixed(4)]
    );
    let q = tr.quantization.as_ref().unwrap();
    assert_eq!(
        (q.method.as_str(), q.bits, q.block_size),
        ("MatMulNBits", 8, Some(32))
    );
    assert_eq!((q.symmetric, q.accuracy_level), (Some(true), Some(4)));
    assert_eq!(q.op_types.as_deref(), Some(&["MatMul".to_string()][..]));
    // Fields the schema does not name are kept, not rejected.
    assert_eq!(q.extra.get("nodes_excluded"), Some(&json!(["proj_out"])));
    assert!(m.graphs.text_encoder.quantization.is_none());
    assert_eq!(m.files.len(), FILES.len());

    m.verify_hashes(&dir).unwrap();
}

#[test]
fn scheduler_options_reach_the_schedule_checks() {
    // An option the runtime does not implement must not be dropped on the way to `schedule`.
    let dir = bundle("karras", |m| {
        m["scheduler"]["use_karras_sigmas"] = json!(true)
    });
    let m = Manifest::load(&dir).unwrap();
    assert!(m.scheduler.shift.use_karras_sigmas);
    let limits = &m.references.limits;
    assert_eq!((limits.min_side, limits.max_area), (64, 1048576));
    assert_eq!(
        m.scheduler.empirical_mu,
        klein::stages::schedule::EmpiricalMu::FLUX2
    );
}

#[test]
fn unknown_fields_are_ignored() {
    let dir = bundle("forward", |m| {
        m["future_section"] = json!({"anything": [1, 2, 3]});
        m["model"]["license"] = json!("apache-2.0");
        m["graphs"]["transformer"]["inputs"][0]["layout"] = json!("NLC");
    });
    Manifest::load(&dir).unwrap();
}

#[test]
fn a_missing_directory_or_manifest_is_explained() {
    let missing = temp_dir("gone").join("not-here");
    let (path, reason) = load_error(&missing);
    assert_eq!(path, missing);
    assert_mentions(&reason, &["does not exist"]);

    let empty = temp_dir("empty");
    let (_, reason) = load_error(&empty);
    assert_mentions(&reason, &["has no manifest.json"]);

    let file = empty.join("file");
    std::fs::write(&file, b"x").unwrap();
    assert_mentions(&load_error(&file).1, &["is not a directory"]);

    // A manifest.json that is a directory is named as such, not as missing.
    let odd = temp_dir("manifest-dir");
    std::fs::create_dir(odd.join("manifest.json")).unwrap();
    let (path, reason) = load_error(&odd);
    assert_eq!(path, odd.join("manifest.json"));
    assert_mentions(&reason, &["is not a file"]);
}

#[test]
fn invalid_json_reports_line_and_column() {
    let dir = bundle("badjson", |_| {});
    write_manifest(&dir, "{\n  \"format_version\": 1,\n  \"model\": {,\n}\n");
    let (path, reason) = load_error(&dir);
    assert_eq!(path, dir.join("manifest.json"));
    assert_mentions(&reason, &["not valid JSON", "line 3 column"]);
}

#[test]
fn only_known_format_versions_are_read() {
    let dir = bundle("v2", |m| m["format_version"] = json!(2));
    assert_mentions(
        &load_error(&dir).1,
        &[
            "format_version 2 is not supported",
            "reads format version 1",
        ],
    );
    let dir = bundle("v-none", |m| {
        m.as_object_mut().unwrap().remove("format_version");
    });
    assert_mentions(
        &load_error(&dir).1,
        &["has no `format_version`", "format version 1"],
    );
}

#[test]
fn required_fields_are_required() {
    let dir = bundle("nopad", |m| {
        m["tokenizer"]
            .as_object_mut()
            .unwrap()
            .remove("pad_token_id");
    });
    assert_mentions(
        &load_error(&dir).1,
        &["missing field `pad_token_id`", "line"],
    );
    let dir = bundle("badprecision", |m| {
        m["graphs"]["vae_encoder"]["precision"] = json!("fp8")
    });
    assert_mentions(&load_error(&dir).1, &["unknown variant `fp8`", "fp32"]);
    let dir = bundle("nograph", |m| {
        m["graphs"].as_object_mut().unwrap().remove("vae_decoder");
    });
    assert_mentions(&load_error(&dir).1, &["missing field `vae_decoder`"]);
}

#[test]
fn missing_and_truncated_files_are_refused() {
    let dir = bundle("missing", |_| {});
    std::fs::remove_file(dir.join("transformer.onnx.data")).unwrap();
    let (path, reason) = load_error(&dir);
    assert_eq!(path, dir.join("transformer.onnx.data"));
    assert_mentions(&reason, &["listed in manifest.json but missing"]);

    let dir = bundle("truncated", |_| {});
    std::fs::write(dir.join("vae_decoder.onnx"), b"vae dec").unwrap();
    let (path, reason) = load_error(&dir);
    assert_eq!(path, dir.join("vae_decoder.onnx"));
    assert_mentions(&reason, &["is 7 bytes, manifest.json says 17", "truncated"]);
}

#[test]
fn hashes_are_verified_on_request() {
    let dir = bundle("tampered", |_| {});
    // Same size, different bytes: only the hash can tell.
    std::fs::write(dir.join("text_encoder.onnx"), b"text encoder BYTES").unwrap();
    std::fs::write(dir.join("vae_encoder.onnx"), b"VAE encoder bytes").unwrap();
    let manifest = Manifest::load(&dir).unwrap();
    match manifest.verify_hashes(&dir) {
        Err(KleinError::Bundle { reason, .. }) => assert_mentions(
            &reason,
            &[
                "2 file(s) do not match",
                "text_encoder.onnx: sha256 is",
                "vae_encoder.onnx",
            ],
        ),
        other => panic!("expected a hash mismatch, got {other:?}"),
    }
}

#[test]
fn files_the_pipeline_reads_must_be_listed_with_safe_paths() {
    let dir = bundle("unlisted", |m| {
        m["files"]
            .as_object_mut()
            .unwrap()
            .remove("transformer.onnx");
    });
    assert_mentions(
        &load_error(&dir).1,
        &["transformer file `transformer.onnx` is not listed in `files`"],
    );

    let dir = bundle("escape", |m| {
        m["files"]["../outside.bin"] = json!({"bytes": 1, "sha256": "0".repeat(64)});
    });
    assert_mentions(
        &load_error(&dir).1,
        &["`../outside.bin` is not a plain path inside the bundle"],
    );

    let dir = bundle("badhash", |m| {
        m["files"]["tokenizer.json"]["sha256"] = json!("abc")
    });
    assert_mentions(
        &load_error(&dir).1,
        &["files.tokenizer.json.sha256 `abc` is not 64 hex digits"],
    );
}

#[test]
fn contradictory_numbers_are_refused() {
    let dir = bundle("inconsistent", |m| {
        m["transformer"]["joint_attention_dim"] = json!(3072);
        m["text_encoder"]["hidden_layers"] = json!([9, 18, 30]);
        m["latents"]["channels"] = json!(64);
    });
    assert_mentions(
        &load_error(&dir).1,
        &[
            "transformer.joint_attention_dim 3072 != text_encoder.embed_dim 7680",
            "hidden_layers has layer 30, outside 1..=27",
            "latents.channels 64",
        ],
    );
    // The model's defaults and the scheduler's numbers: refused in the file, not blamed on a
    // request that gave none of them.
    let dir = bundle("bad-defaults", |m| {
        m["model"]["default_width"] = json!(0);
        m["model"]["default_guidance"] = json!(-5.0);
        m["model"]["default_steps"] = json!(5000);
        m["scheduler"]["num_train_timesteps"] = json!(0);
    });
    let (path, message) = load_error(&dir);
    assert!(path.ends_with("manifest.json"), "{path:?}");
    assert_mentions(
        &message,
        &[
            "model.default_width 0 is outside 16..=4096",
            "model.default_guidance -5 is outside 0..=100",
            "model.default_steps 5000 is outside 1..=1000",
            "scheduler.num_train_timesteps is 0",
        ],
    );
}

// ---- hash verification with a stamp ----

/// A settled bundle and an empty cache directory.
fn stamped_bundle(name: &str) -> (PathBuf, PathBuf, Manifest) {
    let dir = bundle(name, |_| {});
    backdate(&dir);
    let manifest = Manifest::load(&dir).unwrap();
    (dir, temp_dir(&format!("{name}-cache")), manifest)
}

#[track_caller]
fn verify(manifest: &Manifest, dir: &Path, cache: &Path) -> Verification {
    manifest.verify_hashes_cached(dir, Some(cache)).unwrap()
}

/// The sha256 error of a verification that must fail.
#[track_caller]
fn hash_error(result: klein::Result<Verification>) -> String {
    match result {
        Err(KleinError::Bundle { reason, .. }) => reason,
        other => panic!("expected a sha256 mismatch, got {other:?}"),
    }
}

/// The first verification hashes and writes a stamp; the next ones find it and hash nothing.
#[test]
fn unchanged_bundles_are_not_hashed_again() {
    let (dir, cache, manifest) = stamped_bundle("stamp-unchanged");
    let first = verify(&manifest, &dir, &cache);
    assert!(first.hashed, "{first:?}");
    let stamp = first.stamp.clone().expect("a stamp is written");
    assert!(
        stamp.starts_with(cache.join("verified")),
        "{}",
        stamp.display()
    );
    assert!(stamp.is_file());
    for _ in 0..2 {
        let again = verify(&manifest, &dir, &cache);
        assert_eq!(
            again,
            verify(&manifest, &dir, &cache),
            "repeatable: {again:?}"
        );
        assert!(!again.hashed, "the stamp vouches for the files: {again:?}");
        assert_eq!(again.stamp.as_ref(), Some(&stamp));
    }
    // Another path to the same bundle (here with a `.` in it) is the same canonical path.
    let dotted = dir.join(".");
    assert!(!verify(&manifest, &dotted, &cache).hashed);
}

/// Rewriting a file with the same size (so the size check passes) gives it a fresh modification
/// time: the stamp no longer matches, the file is hashed and refused, every time.
#[test]
fn a_tampered_file_is_refused_despite_a_stamp() {
    let (dir, cache, manifest) = stamped_bundle("stamp-tampered");
    assert!(verify(&manifest, &dir, &cache).stamp.is_some());
    std::fs::write(dir.join("text_encoder.onnx"), b"text encoder BYTES").unwrap();
    let manifest = Manifest::load(&dir).unwrap();
    for _ in 0..2 {
        let reason = hash_error(manifest.verify_hashes_cached(&dir, Some(&cache)));
        assert_mentions(
            &reason,
            &[
                "1 file(s) do not match",
                "text_encoder.onnx: sha256 is",
                "manifest.json says",
            ],
        );
    }
}

/// A stamp trusts size and modification time: a rewrite that restores the old time is not seen
/// by it (the documented limit), only by the full check.
#[test]
fn a_stamp_trusts_modification_times() {
    let (dir, cache, manifest) = stamped_bundle("stamp-limit");
    verify(&manifest, &dir, &cache);
    let file = dir.join("vae_encoder.onnx");
    let time = std::fs::metadata(&file).unwrap().modified().unwrap();
    std::fs::write(&file, b"VAE encoder bytes").unwrap();
    std::fs::File::options()
        .write(true)
        .open(&file)
        .unwrap()
        .set_modified(time)
        .unwrap();
    assert!(!verify(&manifest, &dir, &cache).hashed);
    match manifest.verify_hashes(&dir) {
        Err(KleinError::Bundle { reason, .. }) => {
            assert_mentions(&reason, &["vae_encoder.onnx: sha256 is"])
        }
        other => panic!("expected a sha256 mismatch, got {other:?}"),
    }
}

/// Files modified within 2 s of a verification are not stamped (a coarse file-system clock could
/// give a later rewrite the same time): such a bundle is hashed at every load until it settles.
#[test]
fn freshly_written_bundles_are_hashed_until_they_settle() {
    let dir = bundle("stamp-fresh", |_| {});
    let cache = temp_dir("stamp-fresh-cache");
    let manifest = Manifest::load(&dir).unwrap();
    for _ in 0..2 {
        let v = verify(&manifest, &dir, &cache);
        assert_eq!((v.hashed, v.stamp), (true, None));
    }
    backdate(&dir);
    assert!(verify(&manifest, &dir, &cache).stamp.is_some());
    assert!(!verify(&manifest, &dir, &cache).hashed);
}

/// The stamp is keyed by manifest.json too: a new manifest (here one expecting another sha256 for
/// a file) is verified afresh, and refused.
#[test]
fn a_changed_manifest_is_verified_afresh() {
    let (dir, cache, manifest) = stamped_bundle("stamp-manifest");
    verify(&manifest, &dir, &cache);
    let path = dir.join("manifest.json");
    let mut json: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    json["files"]["vae_decoder.onnx"]["sha256"] = json!("0".repeat(64));
    write_manifest(&dir, &serde_json::to_string_pretty(&json).unwrap());
    let edited = Manifest::load(&dir).unwrap();
    assert_mentions(
        &hash_error(edited.verify_hashes_cached(&dir, Some(&cache))),
        &["vae_decoder.onnx: sha256 is", &"0".repeat(64)],
    );
}

/// A cache directory that cannot be written (here a file) only costs hashing; no cache at all
/// hashes every time.
#[test]
fn an_unusable_cache_directory_means_hashing_every_time() {
    let (dir, cache, manifest) = stamped_bundle("stamp-unwritable");
    let not_a_dir = cache.join("file");
    std::fs::write(&not_a_dir, b"x").unwrap();
    for cache in [Some(not_a_dir.as_path()), None] {
        for _ in 0..2 {
            let v = manifest.verify_hashes_cached(&dir, cache).unwrap();
            assert_eq!((v.hashed, v.stamp), (true, None), "cache {cache:?}");
        }
    }
}

/// A manifest stating the 9B's widths over graphs that declare the 4B's (as a 4B manifest copied
/// onto 9B graphs would be): refused, naming each graph that disagrees.
#[test]
fn graph_widths_must_match_the_stated_architecture() {
    let dir = bundle("widths", |m| {
        m["text_encoder"]["hidden_size"] = json!(4096);
        m["text_encoder"]["embed_dim"] = json!(12288);
        m["transformer"]["joint_attention_dim"] = json!(12288);
    });
    let (_, reason) = load_error(&dir);
    assert_mentions(
        &reason,
        &[
            "graphs.text_encoder `prompt_embeds` is 7680 wide but text_encoder.embed_dim is 12288",
            "graphs.transformer `prompt_embeds` is 7680 wide but transformer.joint_attention_dim is 12288",
        ],
    );
}

/// The test manifest's transformer entry (the 4B's: 5 + 20 blocks, 3072 wide) with the KV
/// tensors added, `layers` deep.
fn add_kv_tensors(m: &mut serde_json::Value, layers: u64) {
    let graph = &mut m["graphs"]["transformer"];
    let inputs = graph["inputs"].as_array_mut().unwrap();
    inputs.push(
        json!({"name": "ref_latents", "dtype": "float32", "shape": ["batch", "ref_tokens", 128]}),
    );
    inputs.push(json!({"name": "ref_ids", "dtype": "int64", "shape": ["ref_tokens", 4]}));
    inputs.push(json!({"name": "cached_kv", "dtype": "float32",
        "shape": [layers, 2, "batch", "cached_tokens", 3072]}));
    graph["outputs"].as_array_mut().unwrap().push(
        json!({"name": "ref_kv", "dtype": "float32", "shape": [layers, 2, "batch", "ref_tokens", 3072]}),
    );
}

/// `model.kv_cache` over a plain transformer: refused, naming the tensors a KV graph has.
#[test]
fn kv_flag_needs_the_kv_tensors() {
    let dir = bundle("kv-flag", |m| m["model"]["kv_cache"] = json!(true));
    let (_, reason) = load_error(&dir);
    assert_mentions(
        &reason,
        &[
            "model.kv_cache is set but graphs.transformer has no `ref_latents`",
            "no `cached_kv`",
            "no `ref_kv`",
        ],
    );
}

/// KV tensors without `model.kv_cache` (the runtime would feed them nothing): refused.
#[test]
fn kv_tensors_need_the_kv_flag() {
    let dir = bundle("kv-tensors", |m| add_kv_tensors(m, 25));
    let (_, reason) = load_error(&dir);
    assert_mentions(
        &reason,
        &["graphs.transformer has `ref_latents`, a KV transformer's tensor, but model.kv_cache is not set"],
    );
}

/// A KV cache of another depth than the transformer's blocks: refused, naming it.
#[test]
fn kv_cache_depth_must_match_the_blocks() {
    let dir = bundle("kv-depth", |m| {
        m["model"]["kv_cache"] = json!(true);
        add_kv_tensors(m, 26);
    });
    let (_, reason) = load_error(&dir);
    assert_mentions(
        &reason,
        &["graphs.transformer `cached_kv` axis 0 is 26 but the transformer's layers (num_layers + num_single_layers) is 25"],
    );
}
