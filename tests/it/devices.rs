//! Device settings on the command line, and bundles a device cannot run: refused with exit code 2
//! before any graph loads, naming the bundle, the graph and what would work.

use crate::cli::{assert_refused, edit_manifest, BundleCopy, FAST};

/// The tiny bundle with its transformer marked as 8-bit MatMulNBits in manifest.json (the graph
/// itself is unchanged: the refusal must come from the manifest, before any graph loads).
fn quantized_copy(name: &str) -> BundleCopy {
    let bundle = BundleCopy::new(name);
    edit_manifest(bundle.path(), |m| {
        m["graphs"]["transformer"]["quantization"] = serde_json::json!({
            "method": "MatMulNBits", "bits": 8, "block_size": 32, "symmetric": true, "accuracy_level": 0
        });
    });
    bundle
}

#[test]
fn coreml_refuses_a_quantized_bundle_before_loading() {
    let bundle = quantized_copy("devices-coreml-int8");
    let run = assert_refused(
        &[&["-m", bundle.arg(), "--device", "coreml"], &FAST[..]].concat(),
        &[
            "device coreml",
            bundle.arg(),
            "transformer graph with 8-bit weights",
            "CoreMLExecutionProvider cannot run",
            "--device cpu",
        ],
    );
    // The support check comes before the "built without CoreML" error of a Linux build.
    assert!(!run.stderr.contains("built without"), "{}", run.describe());
}

#[test]
fn cpu_refuses_a_bf16_bundle_before_loading() {
    let bundle = BundleCopy::new("devices-cpu-bf16");
    edit_manifest(bundle.path(), |m| {
        m["graphs"]["text_encoder"]["precision"] = "bf16".into();
    });
    assert_refused(
        &[&["-m", bundle.arg(), "--device", "cpu"], &FAST[..]].concat(),
        &[
            "device cpu",
            "bf16 text_encoder graph",
            "CPUExecutionProvider has no bfloat16 kernels",
            "--precision fp16",
        ],
    );
}

#[test]
fn cpu_refuses_an_unknown_bit_width() {
    let bundle = BundleCopy::new("devices-cpu-3bit");
    edit_manifest(bundle.path(), |m| {
        m["graphs"]["transformer"]["quantization"] =
            serde_json::json!({"method": "MatMulNBits", "bits": 3});
    });
    assert_refused(
        &[&["-m", bundle.arg()], &FAST[..]].concat(),
        &["transformer graph with 3-bit weights", "4 or 8 bits"],
    );
}

#[test]
fn flags_of_another_device_are_refused() {
    for (flags, needles) in [
        (
            &["--cuda-mem-limit", "4"][..],
            &["--cuda-mem-limit", "--device cpu", "--device cuda or auto"][..],
        ),
        (&["--cuda-tf32", "off"], &["--cuda-tf32", "--device cuda"]),
        (
            &["--coreml-cache", "/tmp/klein-coreml-cache"],
            &["--coreml-cache", "--device coreml or auto"],
        ),
        (&["--coreml-units", "cpu-ane"], &["--coreml-units"]),
        // Given with their default value, they are given all the same.
        (
            &["--coreml-units", "all"],
            &["--coreml-units", "--device coreml"],
        ),
        (
            &["--cuda-conv-search", "heuristic"],
            &["--cuda-conv-search", "--device cuda"],
        ),
    ] {
        assert_refused(&[&FAST[..], flags].concat(), needles);
    }
    assert_refused(
        &[&FAST[..], &["--device", "cuda", "--coreml-units", "cpu"]].concat(),
        &["--coreml-units does not apply to --device cuda:0"],
    );
    assert_refused(
        &[
            &FAST[..],
            &["--device", "coreml", "--cpu-cache", "/tmp/klein-cpu-cache"],
        ]
        .concat(),
        &[
            "--cpu-cache does not apply to --device coreml",
            "--device cpu or auto",
        ],
    );
}

#[test]
fn bad_device_settings_are_refused() {
    assert_refused(
        &[&FAST[..], &["--device", "cuda", "--cuda-mem-limit", "0"]].concat(),
        &["--cuda-mem-limit", "above 0 and below 1000000"],
    );
    assert_refused(
        &[&FAST[..], &["--device", "coreml", "--coreml-units", "gpu"]].concat(),
        &["unknown CoreML compute units `gpu`", "cpu-gpu"],
    );
    assert_refused(
        &[
            &FAST[..],
            &["--device", "cuda", "--cuda-conv-search", "fast"],
        ]
        .concat(),
        &["unknown cuDNN conv search `fast`", "heuristic"],
    );
    assert_refused(
        &[&FAST[..], &["--device", "cuda", "--cuda-tf32", "maybe"]].concat(),
        &["`maybe` is not on or off"],
    );
}

/// The cache directory is created before any graph loads; one that cannot be created is named.
#[test]
fn unusable_coreml_cache_directory_is_refused() {
    let file = crate::util::temp_dir("devices-cache-file").join("a-file");
    std::fs::write(&file, "not a directory").unwrap();
    let cache = file.join("cache");
    assert_refused(
        &[
            &FAST[..],
            &[
                "--device",
                "coreml",
                "--coreml-cache",
                cache.to_str().unwrap(),
            ],
        ]
        .concat(),
        &[
            cache.to_str().unwrap(),
            "creating the CoreML model cache directory",
        ],
    );
}

/// `auto` takes every device's settings; on a build without CUDA and CoreML it runs on the CPU.
#[test]
fn auto_accepts_every_device_setting() {
    let out = crate::util::temp_dir("devices-auto").join("out.png");
    let run = crate::cli::generate(
        "a cat",
        &out,
        &[
            &FAST[..],
            &[
                "--device",
                "auto",
                "--cuda-mem-limit",
                "2",
                "--cuda-conv-search",
                "exhaustive",
                "--coreml-units",
                "cpu-gpu",
            ],
        ]
        .concat(),
    );
    run.assert_success(&[&out]);
}

/// Auto checks a bundle against the devices it tries in this build, and names each: a CPU-only
/// build refuses a bf16 bundle (a CUDA build would run it there, skipping the CPU).
#[test]
fn auto_refuses_what_no_device_it_tries_can_run() {
    let bundle = BundleCopy::new("devices-auto-bf16");
    edit_manifest(bundle.path(), |m| {
        m["graphs"]["transformer"]["precision"] = "bf16".into();
    });
    assert_refused(
        &[&["-m", bundle.arg(), "--device", "auto"], &FAST[..]].concat(),
        &[
            "device auto",
            "bf16 transformer graph",
            "no device auto tries in this build can run it",
            "cpu: CPUExecutionProvider has no bfloat16 kernels",
        ],
    );
}
