//! ONNX Runtime sessions on the tiny graphs of `tests/fixtures/graphs/`
//! (regenerate with `tests/fixtures/make_tiny_graphs.py`).

use klein::bundle::contract::check_io;
use klein::bundle::manifest::GraphSpec;
use klein::runtime::{self, Device, SessionConfig, TensorInput};
use klein::KleinError;
use ndarray::{array, Array2};

use crate::util::{assert_mentions, fixture, init_runtime};

fn load(name: &'static str, config: &SessionConfig) -> klein::Result<runtime::Graph> {
    init_runtime();
    runtime::load_graph(name, &fixture(&format!("graphs/{name}.onnx")), config, &[])
}

fn cpu() -> SessionConfig {
    SessionConfig::default()
        .with_device(Device::Cpu)
        .with_intra_threads(1)
}

/// The I/O contract of `affine.onnx`, as a manifest would declare it.
fn affine_spec() -> GraphSpec {
    serde_json::from_value(serde_json::json!({
        "file": "affine.onnx",
        "precision": "fp32",
        "quantization": null,
        "inputs": [
            {"name": "x", "dtype": "float32", "shape": ["batch", 3]},
            {"name": "ids", "dtype": "int64", "shape": ["batch", 3]}
        ],
        "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 3]}]
    }))
    .unwrap()
}

fn bundle_reason(result: klein::Result<()>) -> String {
    match result {
        Err(KleinError::Bundle { reason, .. }) => reason,
        other => panic!("expected a bundle error, got {other:?}"),
    }
}

/// Asserts that `err` is an inference error of the `affine` graph.
fn assert_affine_inference_error(err: &KleinError) {
    let affine = matches!(
        err,
        KleinError::Inference {
            stage: "affine",
            ..
        }
    );
    assert!(
        affine,
        "expected an inference error of `affine`, got {err:?}"
    );
}

#[test]
fn affine_graph_runs_and_returns_exact_values() {
    let mut graph = load("affine", &cpu()).unwrap();
    assert_eq!(graph.device(), Device::Cpu);
    let x = array![[1.0f32, 2.0, 3.0], [4.0, 5.0, 6.0]];
    let ids = array![[1i64, 0, -1], [7, 8, 9]];
    let mut out = graph
        .run(&[("x", x.view().into()), ("ids", ids.view().into())])
        .unwrap();
    let y = out.take("y").unwrap();
    // y = 2x + ids, exact in float32.
    let expected = array![[3.0f32, 4.0, 5.0], [15.0, 18.0, 21.0]].into_dyn();
    assert_eq!(y, expected, "expected {expected:?}, got {y:?}");
    let err = out.take("y").unwrap_err();
    assert_affine_inference_error(&err);
}

#[test]
fn non_contiguous_inputs_are_copied_to_standard_layout() {
    let mut graph = load("affine", &cpu()).unwrap();
    // x^T of a [3, 2] array is a non-contiguous [2, 3] view.
    let xt = array![[1.0f32, 4.0], [2.0, 5.0], [3.0, 6.0]];
    let x = xt.t();
    assert!(!x.is_standard_layout());
    let ids = Array2::<i64>::zeros((2, 3));
    let y = graph
        .run(&[("x", x.into()), ("ids", ids.view().into())])
        .unwrap()
        .take("y")
        .unwrap();
    let expected = array![[2.0f32, 4.0, 6.0], [8.0, 10.0, 12.0]].into_dyn();
    assert_eq!(y, expected, "expected {expected:?}, got {y:?}");
}

#[test]
fn float16_graph_takes_and_returns_f32() {
    let mut graph = load("half", &cpu()).unwrap();
    let x = array![0.5f32, 1.5, -2.0, 1000.0];
    let y = graph
        .run(&[("x", x.view().into())])
        .unwrap()
        .take("y")
        .unwrap();
    // y = x + 1 in float16; all four values are exact in float16.
    let expected = array![1.5f32, 2.5, -1.0, 1001.0].into_dyn();
    assert_eq!(y, expected, "expected {expected:?}, got {y:?}");
}

/// `run_then_free_arena` writes its outputs outside the arena (float32 and float16 graphs, the
/// values `run` gives) and refuses an output list that does not name each output once.
#[test]
fn runs_that_free_the_arena_give_the_same_outputs() {
    let mut graph = load("affine", &cpu()).unwrap();
    let x = array![[1.0f32, 2.0, 3.0], [4.0, 5.0, 6.0]];
    let ids = array![[1i64, 0, -1], [7, 8, 9]];
    let inputs = [("x", x.view().into()), ("ids", ids.view().into())];
    let plain = graph.run(&inputs).unwrap().take("y").unwrap();
    for _ in 0..2 {
        let freed = graph.run_then_free_arena(&inputs, &[("y", &[2, 3])]);
        assert_eq!(freed.unwrap().take("y").unwrap(), plain);
    }
    for wrong in [
        &[][..],
        &[("z", &[2usize, 3][..])][..],
        &[("y", &[2, 3][..]), ("y", &[2, 3][..])][..],
    ] {
        let err = graph.run_then_free_arena(&inputs, wrong).unwrap_err();
        assert_affine_inference_error(&err);
        assert_mentions(
            &err.to_string(),
            &["outside the arena", "the graph's are y"],
        );
    }
    let mut half = load("half", &cpu()).unwrap();
    let x = array![0.5f32, 1.5, -2.0, 1000.0];
    let y = half.run_then_free_arena(&[("x", x.view().into())], &[("y", &[4])]);
    let expected = array![1.5f32, 2.5, -1.0, 1001.0].into_dyn();
    assert_eq!(y.unwrap().take("y").unwrap(), expected);
}

/// `run_with_constants` binds `ids` once per key (IoBinding) and gives what `run` gives: the
/// first key's constants stay bound while its later calls pass other ones (ignored), a new key
/// binds its own, and keys beyond the two kept are bound again.
#[test]
fn constants_are_bound_once_per_key() {
    let mut graph = load("affine", &cpu()).unwrap();
    let ids_a = array![[1i64, 2, 3]];
    let ids_b = array![[10i64, 20, 30]];
    let y = |graph: &mut runtime::Graph, key: u64, ids: &Array2<i64>, x: f32| {
        let x = array![[x, x, x]];
        graph
            .run_with_constants(
                key,
                &[("ids", ids.view().into())],
                &[("x", x.view().into())],
            )
            .unwrap()
            .take("y")
            .unwrap()
    };
    // y = 2x + ids
    assert_eq!(
        y(&mut graph, 7, &ids_a, 1.0),
        array![[3.0f32, 4.0, 5.0]].into_dyn()
    );
    assert_eq!(
        y(&mut graph, 7, &ids_b, 2.0),
        array![[5.0f32, 6.0, 7.0]].into_dyn(),
        "key 7 keeps the ids bound first"
    );
    assert_eq!(
        y(&mut graph, 8, &ids_b, 0.0),
        array![[10.0f32, 20.0, 30.0]].into_dyn()
    );
    assert_eq!(
        y(&mut graph, 7, &ids_b, 0.0),
        array![[1.0f32, 2.0, 3.0]].into_dyn()
    );
    // Keys 9 then 10 push 7 out (two are kept): 7 binds the ids it is given now.
    y(&mut graph, 9, &ids_a, 0.0);
    y(&mut graph, 10, &ids_a, 0.0);
    assert_eq!(
        y(&mut graph, 7, &ids_b, 0.0),
        array![[10.0f32, 20.0, 30.0]].into_dyn()
    );
    let plain = graph
        .run(&[
            ("x", Array2::<f32>::zeros((1, 3)).view().into()),
            ("ids", ids_b.view().into()),
        ])
        .unwrap()
        .take("y")
        .unwrap();
    assert_eq!(plain, array![[10.0f32, 20.0, 30.0]].into_dyn());
    // The same input checks as `run`: given twice, or missing.
    let x = Array2::<f32>::zeros((1, 3));
    for (constants, inputs, needle) in [
        (
            vec![("ids", ids_a.view().into())],
            vec![("ids", ids_a.view().into())],
            "input `ids` given twice",
        ),
        (
            vec![],
            vec![("x", x.view().into())],
            "input `ids` was not given",
        ),
    ] {
        let constants: Inputs<'_> = constants;
        let inputs: Inputs<'_> = inputs;
        let err = graph
            .run_with_constants(11, &constants, &inputs)
            .unwrap_err();
        assert_mentions(&err.to_string(), &["affine", needle]);
    }
}

/// Named inputs of one `Graph::run` call.
type Inputs<'a> = Vec<(&'a str, TensorInput<'a>)>;

#[test]
fn run_rejects_bad_inputs_with_the_stage_and_reason() {
    let mut graph = load("affine", &cpu()).unwrap();
    let x = Array2::<f32>::zeros((2, 3));
    let ids = Array2::<i64>::zeros((2, 3));
    let bad_ids = Array2::<i64>::zeros((3, 3));
    let cases: Vec<(&str, Inputs<'_>, Vec<&str>)> = vec![
        (
            "missing input",
            vec![("x", x.view().into())],
            vec!["`ids` was not given"],
        ),
        (
            "unknown input",
            vec![
                ("x", x.view().into()),
                ("ids", ids.view().into()),
                ("z", x.view().into()),
            ],
            vec!["no input `z`", "x, ids"],
        ),
        (
            "wrong dtype",
            vec![("x", ids.view().into()), ("ids", ids.view().into())],
            vec!["input `x` takes float32, was given int64"],
        ),
        (
            "given twice",
            vec![("x", x.view().into()), ("x", x.view().into())],
            vec!["`x` given twice"],
        ),
        (
            "shapes ORT rejects",
            vec![("x", x.view().into()), ("ids", bad_ids.view().into())],
            vec!["running", "affine.onnx"],
        ),
    ];
    for (what, inputs, needles) in cases {
        match graph.run(&inputs) {
            Err(KleinError::Inference { stage, message }) => {
                assert_eq!(stage, "affine", "{what}");
                assert_mentions(&message, &needles);
            }
            other => panic!("{what}: expected an inference error, got {other:?}"),
        }
    }
}

#[test]
fn io_check_accepts_the_contract_and_names_every_mismatch() {
    let graph = load("affine", &cpu()).unwrap();
    check_io(&affine_spec(), &graph).unwrap();

    let mut renamed = affine_spec();
    renamed.inputs[0].name = "latents".to_string();
    let reason = bundle_reason(check_io(&renamed, &graph));
    assert_mentions(
        &reason,
        &[
            "affine graph",
            "input `latents` is in manifest.json but not in the graph",
            "input `x` (float32) is in the graph but not in manifest.json",
        ],
    );

    let mut retyped = affine_spec();
    retyped.inputs[1].dtype = klein::runtime::Dtype::Float32;
    let reason = bundle_reason(check_io(&retyped, &graph));
    assert_mentions(&reason, &["input `ids`: expected float32, found int64"]);

    let mut resized = affine_spec();
    resized.outputs[0].shape[1] = klein::bundle::manifest::DimSpec::Fixed(4);
    let reason = bundle_reason(check_io(&resized, &graph));
    assert_mentions(&reason, &["output `y` dimension 1: expected 4", "found 3"]);

    let mut reranked = affine_spec();
    reranked.outputs[0]
        .shape
        .push(klein::bundle::manifest::DimSpec::Named("extra".into()));
    let reason = bundle_reason(check_io(&reranked, &graph));
    assert_mentions(
        &reason,
        &[
            "output `y`: expected shape [batch, 3, extra] (rank 3)",
            "(rank 2)",
        ],
    );
}

#[test]
fn metadata_props_are_read_back_and_checked() {
    let graph = load("affine", &cpu()).unwrap();
    let meta = graph.metadata();
    assert_eq!(
        meta.get("klein.component").map(String::as_str),
        Some("affine")
    );
    assert_eq!(
        meta.get("klein.format_version").map(String::as_str),
        Some("1")
    );
    assert_eq!(
        meta.get("klein.precision").map(String::as_str),
        Some("fp32")
    );
    assert_eq!(
        meta.get("klein.quantization").map(String::as_str),
        Some("none")
    );

    let spec = affine_spec();
    spec.check_metadata("affine", meta, graph.path()).unwrap();
    let reason = bundle_reason(spec.check_metadata("transformer", meta, graph.path()));
    assert_mentions(
        &reason,
        &["klein.component is `affine`, expected `transformer`"],
    );
    let mut fp16 = affine_spec();
    fp16.precision = klein::bundle::manifest::Precision::Fp16;
    let reason = bundle_reason(fp16.check_metadata("affine", meta, graph.path()));
    assert_mentions(
        &reason,
        &["klein.precision is `fp32`, manifest.json says `fp16`"],
    );

    let bare = load("no_metadata", &cpu()).unwrap();
    assert!(bare.metadata().is_empty(), "{:?}", bare.metadata());
    let reason = bundle_reason(spec.check_metadata("affine", bare.metadata(), bare.path()));
    assert_mentions(&reason, &["no `klein.component` metadata"]);
}

#[test]
fn auto_device_records_the_provider_used() {
    let graph = load("affine", &SessionConfig::default()).unwrap();
    // The library from scripts/setup-ort.sh is the CPU build: Auto ends on the CPU, and says why
    // it skipped each accelerator compiled in.
    assert_eq!(graph.device(), Device::Cpu);
    let skipped: Vec<Device> = graph.skipped_devices().iter().map(|(d, _)| *d).collect();
    let mut expected = Vec::new();
    if cfg!(feature = "cuda") {
        expected.push(Device::Cuda(0));
    }
    if cfg!(feature = "coreml") {
        expected.push(Device::CoreMl);
    }
    assert_eq!(skipped, expected, "{:?}", graph.skipped_devices());
}

#[cfg(not(feature = "cuda"))]
#[test]
fn a_named_device_that_is_unavailable_is_an_error_not_a_cpu_fallback() {
    match load("affine", &cpu().with_device(Device::Cuda(1))) {
        Err(KleinError::Device { device, message }) => {
            assert_eq!(device, "cuda:1");
            assert_mentions(&message, &["--features cuda"]);
        }
        other => panic!("expected a device error, got {other:?}"),
    }
}

#[test]
fn a_missing_graph_file_is_a_bundle_error() {
    init_runtime();
    let path = fixture("graphs/does_not_exist.onnx");
    match runtime::load_graph("transformer", &path, &cpu(), &[]) {
        Err(KleinError::Bundle { path: p, reason }) => {
            assert_eq!(p, path);
            assert_mentions(&reason, &["transformer graph file is missing"]);
        }
        other => panic!("expected a bundle error, got {other:?}"),
    }
}

#[test]
fn devices_parse_and_print() {
    for (text, device, ep) in [
        ("cpu", Device::Cpu, "CPUExecutionProvider"),
        ("CUDA", Device::Cuda(0), "CUDAExecutionProvider"),
        ("cuda:3", Device::Cuda(3), "CUDAExecutionProvider"),
        (" coreml ", Device::CoreMl, "CoreMLExecutionProvider"),
        ("auto", Device::Auto, "auto"),
    ] {
        let parsed: Device = text.parse().unwrap();
        assert_eq!(parsed, device, "{text}");
        assert_eq!(parsed.ep_name(), ep);
        assert_eq!(parsed.to_string().parse::<Device>().unwrap(), device);
    }
    for bad in ["gpu", "cuda:", "cuda:-1", "cuda:x", ""] {
        let err = bad.parse::<Device>().unwrap_err().to_string();
        assert_mentions(
            &err,
            &["unknown device", "cpu, cuda, cuda:N, coreml or auto"],
        );
    }
}

/// int8 products come out right on this CPU. `int8_products.onnx` is the worst case for the u8 x s8
/// kernels of x86-64 CPUs without VNNI, which sum pairs of products in 16 bits with saturation:
/// activations 255 (x = 1, the top of its range) against weight codes 127 make every pair
/// 64770 > 32767, so a run without `session.x64quantprecision` there returns about half (0.5x
/// under `benches/avx2-host.sh`; `avx2_host.rs` runs this test there). Elsewhere the products are
/// exact anyway.
#[test]
fn int8_products_do_not_saturate() {
    let mut graph = load("int8_products", &cpu()).unwrap();
    check_int8_products(&mut graph, 1.27);
}

/// The same worst case with `--reduce-range`'s largest code, 64: pairs of at most 32640, which the
/// u8 x s8 kernels hold, so a session told the weights are 7-bit keeps those kernels and is exact
/// (`avx2_host.rs` runs it under `benches/avx2-host.sh`, where the session then runs without
/// `session.x64quantprecision`).
#[test]
fn seven_bit_int8_products_do_not_saturate() {
    let mut graph = load("int8_products_7bit", &cpu().with_7bit_int8_weights(true)).unwrap();
    check_int8_products(&mut graph, 0.64);
}

/// Runs `DynamicQuantizeMatMul(x, codes, 0.01)` with every code `code_times_scale / 0.01`.
fn check_int8_products(graph: &mut runtime::Graph, code_times_scale: f32) {
    // Row 0: every activation 1 (quantized to 255, scale 1/255); row 1: 1 and 0 alternating, whose
    // pairs stay below 32767 on every kernel.
    let x = Array2::from_shape_fn(
        (2, 64),
        |(row, k)| {
            if row == 0 || k % 2 == 0 {
                1.0f32
            } else {
                0.0
            }
        },
    );
    let y = graph
        .run(&[("x", x.view().into())])
        .unwrap()
        .take("y")
        .unwrap();
    // y = sum_k x_k * code * 0.01; the only rounding is float32's (scale 1/255, the products).
    for (row, expected) in [(0, 64.0 * code_times_scale), (1, 32.0 * code_times_scale)] {
        for n in 0..16 {
            let got = y[[row, n]];
            assert!(
                (got - expected).abs() <= 1e-4 * expected,
                "row {row}, column {n}: {got} against {expected}"
            );
        }
    }
}
