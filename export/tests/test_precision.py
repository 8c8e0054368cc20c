"""fp16, int8 and int4 bundles of the tiny checkpoint: export, manifest and metadata, what runs in which
precision, error against torch fp32 per component and PSNR of the final image against diffusers fp32.

Tolerances are those of `klein_export.tolerances` (stated and justified there): per component, the fp32
rule with its floor scaled by the scheme's unit error (fp16 2^-11, int8 2^-8, int4 2^-4, against
float32's 2^-24), and for quantized float32 graphs agreement to the fp32 rule with torch running the
quantizer's own dequantized weights; per image, PSNR_THRESHOLD (fp32 80, fp16 40, int8 24, int4 18 dB)
and EMULATED_PSNR (80 dB against diffusers with the dequantized weights).
"""

import collections
import collections.abc
import hashlib
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from klein_binary import KLEIN
from onnx import TensorProto
from PIL import Image

from klein_export import FORMAT_VERSION
from klein_export.against import component_differences, image_difference
from klein_export.cli import main
from klein_export.contract import COMPONENTS
from klein_export.convert import convert
from klein_export.int8_kernels import cpu_session, session_options
from klein_export.norm_parts import PARTS
from klein_export.precision import (
    FLOAT16_MAX,
    KEEP_FLOAT32,
    PrecisionError,
    bfloat16_support,
    measure_ranges,
    summarise_ranges,
)
from klein_export.quantize import (
    DYNAMIC,
    QuantizationConfig,
    QuantizationError,
    parse_components,
    quantize_copy,
    quantize_graph,
)
from klein_export.tolerances import PSNR_THRESHOLD
from klein_export.verify import IMAGE_CASES, verify, verify_images

QUANTIZED = ("text_encoder", "transformer")
# Matrix products of the tiny checkpoint that hold a constant weight and are exported as MatMul:
# Qwen3 27 layers x (q, k, v, o, gate, up, down); the MM-DiT's 2 double blocks x 12 + 2 single x 2 +
# x_embedder, context_embedder, proj_out. The 6 per-image projections (timestep embedder, modulation,
# norm_out; MatMul with the weight first, ort_fusions.weight_first_vector_products) stay float.
MATMUL_WEIGHTS = {"text_encoder": 27 * 7, "transformer": 2 * 12 + 2 * 2 + 3}
# Quantized, a product only cut into column ranges is computed as one product per range
# (product_splits.py): each double block's two feed-forward inputs in 2 halves (+1 each), each single
# block's q/k/v/MLP projection in 5 parts (+4); a product of a concatenation as one product per part:
# each single block's `to_out` (attention output 64 + SwiGLU output 192, on the 32-row blocks) (+1).
CUT_PRODUCTS = {**MATMUL_WEIGHTS, "transformer": MATMUL_WEIGHTS["transformer"] + 2 * 2 + 2 * 4 + 2 * 1}
SPLIT_INPUTS = {"text_encoder": 0, "transformer": 2}
# Ops allowed to see a float16 tensor in an fp16 graph: the products, their bias Add, the embedding
# lookup and the casts around them. Everything else (norms, softmax, RoPE, modulation) is float32.
FLOAT16_OPS = {"Cast", "MatMul", "Gemm", "Conv", "Gather", "Add"}
# The transformer's fused attention also runs in float16 (fused_attention.py, `half`): its query, key and
# value are cast, flattened to [B, S, H*D] and back (Shape, Slice... of their shapes are int64).
ATTENTION_OPS = {"MultiHeadAttention", "Reshape", "Shape"}
ROW_SLICES = {"Slice"}
# The decoder's upsamplers' four float16 phase convolutions are concatenated and interleaved in float16
# (upsample_convs.py; the float32 Resize before them becomes a Cast of the source).
INTERLEAVE_OPS = {"Concat", "DepthToSpace"}


# The quantized and fp16 bundles by name, with the session fixture (conftest.py) that makes each.
BUNDLE_FIXTURES = {
    "fp16": "fp16_bundle",
    "int8": "int8_bundle",
    "int4": "int4_bundle",
    "int8-dynamic": "dynamic_bundle",
    "int8-static": "static_bundle",
    "int8-7bit": "reduced_bundle",
}


class _Bundles(collections.abc.Mapping):
    """The bundles of BUNDLE_FIXTURES, each made when a test first reads it: a run of some tests
    (`-m int8_kernels`) exports only the bundles they read."""

    def __init__(self, request):
        self._request = request

    def __getitem__(self, name):
        return self._request.getfixturevalue(BUNDLE_FIXTURES[name])

    def __iter__(self):
        return iter(BUNDLE_FIXTURES)

    def __len__(self):
        return len(BUNDLE_FIXTURES)


@pytest.fixture
def bundles(request):
    return _Bundles(request)


def _manifest(bundle):
    return json.loads((bundle / "manifest.json").read_text())


def _metadata(path):
    """The klein.* metadata of a graph, which must also carry a COREML_CACHE_KEY (test_static_shapes.py)."""
    meta = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    assert len(meta.pop("COREML_CACHE_KEY")) == 64, path
    return meta


def _check_files(bundle, manifest):
    files = {p.name for p in bundle.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == files
    for name, entry in manifest["files"].items():
        data = (bundle / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


def _tensor_types(model):
    model = onnx.shape_inference.infer_shapes(model)
    graph = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    types.update({i.name: i.data_type for i in graph.initializer})
    return types


def test_fp16_manifest_and_metadata(fp16_bundle, tiny_bundle):
    manifest = _manifest(fp16_bundle)
    fp32 = _manifest(tiny_bundle)
    _check_files(fp16_bundle, manifest)
    for component in COMPONENTS:
        spec = manifest["graphs"][component]
        assert (spec["precision"], spec["quantization"]) == ("fp16", None), component
        # The I/O contract is unchanged: graph inputs and outputs stay float32 / int64.
        assert (spec["inputs"], spec["outputs"]) == (
            fp32["graphs"][component]["inputs"],
            fp32["graphs"][component]["outputs"],
        )
        assert spec["precision_scheme"]["float16_module_count"] > 0
        assert _metadata(fp16_bundle / spec["file"]) == {
            "klein.component": component,
            "klein.precision": "fp16",
            "klein.quantization": "none",
            "klein.format_version": str(FORMAT_VERSION),
        }
    assert {c for c in COMPONENTS if "float16_ops" in manifest["graphs"][c]["precision_scheme"]} == {"transformer"}
    assert manifest["graphs"]["vae_decoder"]["fusions"]["upsamplers_as_phase_convs"] == 3  # through the Casts
    kept = manifest["graphs"]["transformer"]["precision_scheme"]["kept_float32"]
    assert {name.split(".")[1] for name in kept} == set(KEEP_FLOAT32["transformer"]), kept


def test_fp16_graphs_keep_norms_and_modulation_in_float32(fp16_bundle):
    for component in COMPONENTS:
        model = onnx.load(str(fp16_bundle / f"{component}.onnx"))
        types = _tensor_types(model)
        initializers = {i.name for i in model.graph.initializer}
        for v in [*model.graph.input, *model.graph.output]:
            assert types[v.name] in (TensorProto.FLOAT, TensorProto.INT64), (
                f"{component}: {v.name} is not float32/int64"
            )
        half = {}
        for node in model.graph.node:
            if TensorProto.FLOAT16 in (types[name] for name in [*node.input, *node.output] if name):
                half.setdefault(node.op_type, []).append(node)
        # The text encoder's key and value projections read their float16 input's real rows (a Slice,
        # exact: real_keys.py), one per layer.
        slices = ROW_SLICES if component == "text_encoder" else set()
        allowed = FLOAT16_OPS | slices | (ATTENTION_OPS if component == "transformer" else set())
        allowed |= INTERLEAVE_OPS if component == "vae_decoder" else set()
        assert set(half) <= allowed, f"{component}: float16 reaches {set(half) - allowed}"
        users = {}
        for node in model.graph.node:
            for name in node.input:
                users.setdefault(name, []).append(node.op_type)
        assert all(users[n.output[0]] == ["MatMul"] * 2 for n in half.get("Slice", [])), component
        if component == "transformer":
            attention = [n for n in model.graph.node if n.op_type == "MultiHeadAttention"]
            assert attention and all(n in half["MultiHeadAttention"] for n in attention)
        assert "MatMul" in half or "Conv" in half, f"{component}: no product runs in float16"
        # A float16 Add is a bias (one operand a weight), never the residual stream.
        assert all(any(i in initializers for i in n.input) for n in half.get("Add", [])), component
        # The per-image projections (timestep embedder, modulation, final AdaLayerNorm: MatMul with the
        # weight first) keep float32 weights.
        weight_first = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[0] in initializers]
        assert len(weight_first) == (6 if component == "transformer" else 0), component
        assert not [n for n in weight_first if n in half.get("MatMul", [])], component
        assert "Gemm" not in half, component
        assert sum(i.data_type == TensorProto.FLOAT16 for i in model.graph.initializer) > 0


@pytest.mark.parametrize("name, bits", [("int8", 8), ("int4", 4)])
def test_quantized_manifest_and_metadata(bundles, tiny_bundle, name, bits):
    bundle = bundles[name]
    manifest = _manifest(bundle)
    _check_files(bundle, manifest)
    for component in COMPONENTS:
        spec = manifest["graphs"][component]
        meta = _metadata(bundle / spec["file"])
        assert (spec["precision"], meta["klein.precision"]) == ("fp32", "fp32")
        assert (spec["inputs"], spec["outputs"]) == (
            _manifest(tiny_bundle)["graphs"][component]["inputs"],
            _manifest(tiny_bundle)["graphs"][component]["outputs"],
        )
        if component not in QUANTIZED:
            assert spec["quantization"] is None and meta["klein.quantization"] == "none", component
            assert manifest["files"][spec["file"]] == _manifest(tiny_bundle)["files"][spec["file"]], (
                "VAE graph unchanged"
            )
            continue
        q = spec["quantization"]
        assert {k: q[k] for k in ("method", "bits", "block_size", "symmetric", "accuracy_level", "op_types")} == {
            "method": "MatMulNBits",
            "bits": bits,
            "block_size": 32,
            "symmetric": True,
            "accuracy_level": 0,
            "op_types": ["MatMul"],
        }
        assert (q["quantized_nodes"], q["quantized_weights"]) == (CUT_PRODUCTS[component], MATMUL_WEIGHTS[component])
        assert q["split_inputs"] == SPLIT_INPUTS[component]
        assert json.loads(meta["klein.quantization"]) == q
        model = onnx.load(str(bundle / spec["file"]))
        nbits = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        assert len(nbits) == CUT_PRODUCTS[component]
        assert all({a.name: a.i for a in n.attribute}["bits"] == bits for n in nbits)
        weights = {i.name for i in model.graph.initializer}
        assert not [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights], (
            "a constant-weight MatMul left in float"
        )
        # Left in float: the transformer's 6 per-image projections, MatMul with the weight first.
        assert q["float_nodes"] == ({"MatMul": 6} if component == "transformer" else {"Gather": 1}), component


def test_dynamic_manifest_and_graphs(bundles, tiny_bundle):
    """`--method dynamic`: every constant-weight MatMul becomes DynamicQuantizeMatMul with int8 codes,
    one float32 scale per output channel and zero points of 0; the manifest and metadata say so."""
    bundle = bundles["int8-dynamic"]
    manifest = _manifest(bundle)
    _check_files(bundle, manifest)
    for component in QUANTIZED:
        spec = manifest["graphs"][component]
        q = spec["quantization"]
        assert {k: q[k] for k in ("method", "bits", "block_size", "symmetric", "accuracy_level")} == {
            "method": "DynamicQuantizeMatMul",
            "bits": 8,
            "block_size": None,
            "symmetric": True,
            "accuracy_level": None,
        }
        assert "per output channel" in q["granularity"] and "per tensor" in q["granularity"]
        assert q["quantized_nodes"] == CUT_PRODUCTS[component]
        assert json.loads(_metadata(bundle / spec["file"])["klein.quantization"]) == q
        model = onnx.load(str(bundle / spec["file"]))
        weights = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
        nodes = [n for n in model.graph.node if n.op_type == "DynamicQuantizeMatMul"]
        assert len(nodes) == CUT_PRODUCTS[component] and all(n.domain == "com.microsoft" for n in nodes)
        products = {o for n in nodes for o in n.output}
        cuts = [n.name for n in model.graph.node if n.op_type in ("Split", "Slice") and n.input[0] in products]
        assert not cuts, cuts
        assert q["split_inputs"] == SPLIT_INPUTS[component]
        concats = {n.output[0] for n in model.graph.node if n.op_type == "Concat"}
        assert not [n.name for n in nodes if n.input[0] in concats], "a product still reads a concatenation"
        for node in nodes:
            codes, scale, zero = (weights[name] for name in node.input[1:4])
            assert codes.dtype == np.int8 and codes.ndim == 2 and np.abs(codes).max() == 127, node.name
            assert scale.dtype == np.float32 and scale.shape == (codes.shape[1],) and (scale > 0).all()
            assert zero.dtype == np.int8 and not zero.any()
        assert not [n.name for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    assert manifest["graphs"]["vae_decoder"] == _manifest(tiny_bundle)["graphs"]["vae_decoder"]


def _int8_codes(model: onnx.ModelProto) -> list:
    """(node name, int8 weight codes) of every DynamicQuantizeMatMul and QDQ convolution weight."""
    weights = {i.name: i for i in model.graph.initializer}
    codes = []
    for node in model.graph.node:
        name = {"DynamicQuantizeMatMul": 1, "DequantizeLinear": 0}.get(node.op_type)
        tensor = weights.get(node.input[name]) if name is not None else None
        if tensor is not None and tensor.data_type == TensorProto.INT8 and len(tensor.dims) >= 2:
            codes.append((node.name, onnx.numpy_helper.to_array(tensor)))
    return codes


@pytest.mark.int8_kernels
def test_reduce_range_writes_7_bit_codes(bundles, tiny_bundle, tmp_path, capsys):
    """`--reduce-range`: every int8 weight code of the dynamic products and the static convolutions is
    within [-64, 64], each output channel reaching 64 (scale max |w| / 64), and the manifest and
    metadata say so; without it codes reach 127 and `reduce_range` is false. The error grows a little
    against the 8-bit codes (the runtime's side: `seven_bit_int8_products_do_not_saturate`)."""
    reduced, full = (
        _manifest(bundles["int8-7bit"]),
        {"dynamic": bundles["int8-dynamic"], "static": bundles["int8-static"]},
    )
    _check_files(bundles["int8-7bit"], reduced)
    for component, method in (("text_encoder", "dynamic"), ("transformer", "dynamic"), ("vae_decoder", "static")):
        q = reduced["graphs"][component]["quantization"]
        assert q["reduce_range"] is True and "[-64, 64] (7 bits" in q["granularity"], component
        assert json.loads(_metadata(bundles["int8-7bit"] / q_file(reduced, component))["klein.quantization"]) == q
        codes = _int8_codes(onnx.load(str(bundles["int8-7bit"] / q_file(reduced, component))))
        assert len(codes) == q["quantized_nodes"], component
        # A product split along its input (product_splits.py): its parts' rows together hold each channel.
        weights = {}
        for name, c in codes:
            weights.setdefault(name.split("_rows_")[0], []).append(c)
        for name, parts in weights.items():
            c = np.concatenate(parts) if len(parts) > 1 else parts[0]
            # Per output channel: the last axis of a MatMul weight [K, N], the first of a Conv's [O, I, kh, kw].
            channel_max = np.abs(c).max(axis=0) if c.ndim == 2 else np.abs(c.reshape(c.shape[0], -1)).max(axis=1)
            assert channel_max.max() == 64 and (channel_max >= 63).all(), (component, name)
        other = _manifest(full[method])["graphs"][component]["quantization"]
        assert other["reduce_range"] is False, component
        full_codes = _int8_codes(onnx.load(str(full[method] / q_file(reduced, component))))
        assert max(np.abs(c).max() for _, c in full_codes) == 127, component
    seven = {d.component: d for d in component_differences(bundles["int8-7bit"], tiny_bundle, 64, 64)}
    eight = {d.component: d for d in component_differences(bundles["int8-dynamic"], tiny_bundle, 64, 64)}
    for component in QUANTIZED:
        assert eight[component].rms_rel < seven[component].rms_rel, component
    # MatMulNBits has no int8 compute to protect: refused, nothing written.
    out = tmp_path / "nbits"
    assert (
        main(["quantize", "--bundle", str(tiny_bundle), "--out", str(out), "--quantize", "int8", "--reduce-range"]) == 2
    )
    assert "--reduce-range is for int8 compute" in capsys.readouterr().err and not out.exists()
    assert main(["convert", "--checkpoint", "unused", "--out", str(out), "--reduce-range"]) == 2
    assert "--reduce-range apply with --quantize only" in capsys.readouterr().err


def test_reduce_range_refuses_codes_outside_7_bits(tmp_path):
    """The runtime trusts `reduce_range`, so the exporter checks the codes the quantizer wrote."""
    from klein_export.quantize import _check_code_range

    for largest, refused in ((64, False), (-64, False), (65, True), (-127, True)):
        codes = np.zeros((4, 3), np.int8)
        codes[1, 2] = largest
        graph = onnx.helper.make_graph([], "g", [], [], [onnx.numpy_helper.from_array(codes, "w")])
        model = onnx.helper.make_model(graph)
        if refused:
            with pytest.raises(QuantizationError, match=f"codes up to {abs(largest)} in w, expected at most 64"):
                _check_code_range(model, tmp_path / "g.onnx")
        else:
            _check_code_range(model, tmp_path / "g.onnx")


def q_file(manifest: dict, component: str) -> str:
    return manifest["graphs"][component]["file"]


def test_dynamic_refuses_what_it_cannot_do(tiny_bundle, tmp_path, capsys):
    for flags in (
        ["--quantize", "int4"],
        ["--quantize", "int8", "--block-size", "64"],
        ["--quantize", "int8", "--asymmetric"],
        ["--quantize", "int8", "--accuracy-level", "4"],
    ):
        out = tmp_path / "x"
        assert main(["quantize", "--bundle", str(tiny_bundle), "--out", str(out), "--method", "dynamic", *flags]) == 2
        assert "--method dynamic quantizes to int8" in capsys.readouterr().err and not out.exists(), flags
    assert main(["quantize", "--bundle", str(tiny_bundle), "--out", str(tmp_path / "y"), "--method", "dynamic"]) == 2
    assert "--quantize int8 is required" in capsys.readouterr().err  # dynamic is 8-bit only
    assert main(["convert", "--checkpoint", "unused", "--out", str(tmp_path / "z"), "--method", "dynamic"]) == 2
    assert "--method apply with --quantize only" in capsys.readouterr().err


def test_static_manifest_and_graphs(bundles, tiny_bundle):
    """`--method static`: every Conv of the VAE decoder but the RGB output conv takes its weight from a
    DequantizeLinear of int8 codes with one scale per output channel, and its input through a uint8
    QuantizeLinear/DequantizeLinear pair; ONNX Runtime's CPU provider fuses them into QLinearConv, and
    the upsamplers' phases are concatenated and interleaved on uint8. The output conv stays float. The
    other graphs are the fp32 bundle's."""
    import onnxruntime as ort

    bundle = bundles["int8-static"]
    manifest, fp32 = _manifest(bundle), _manifest(tiny_bundle)
    _check_files(bundle, manifest)
    for component in ("text_encoder", "transformer", "vae_encoder"):
        assert manifest["graphs"][component] == fp32["graphs"][component], component
    spec = manifest["graphs"]["vae_decoder"]
    q = spec["quantization"]
    assert {k: q[k] for k in ("method", "bits", "symmetric", "op_types")} == {
        "method": "QDQ",
        "bits": 8,
        "symmetric": True,
        "op_types": ["Concat", "Conv", "DepthToSpace"],
    }
    assert "calibrat" in q["granularity"] and "256x256" in q["calibration"]
    assert json.loads(_metadata(bundle / spec["file"])["klein.quantization"]) == q
    model = onnx.load(str(bundle / spec["file"]))
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    made_by = {o: n for n in model.graph.node for o in n.output}
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    float_convs = [n for n in onnx.load(str(tiny_bundle / spec["file"])).graph.node if n.op_type == "Conv"]
    # The RGB output conv (3 output channels) stays float; every other conv is quantized.
    rgb = [n for n in convs if n.input[1] in weights and weights[n.input[1]].shape[0] == 3]
    assert len(rgb) == 1 and weights[rgb[0].input[1]].dtype == np.float32, [n.name for n in rgb]
    assert len(convs) == len(float_convs) == q["quantized_nodes"] + 1 and q["float_nodes"]["Conv"] == 1
    assert "RGB output convolution" in q["left_in_float"]
    for conv in (n for n in convs if n is not rgb[0]):
        weight_dq, input_dq = made_by[conv.input[1]], made_by[conv.input[0]]
        assert (weight_dq.op_type, input_dq.op_type) == ("DequantizeLinear", "DequantizeLinear"), conv.name
        codes, scale = weights[weight_dq.input[0]], weights[weight_dq.input[1]]
        assert codes.dtype == np.int8 and scale.shape == (codes.shape[0],) and (scale > 0).all(), conv.name
        assert weights[input_dq.input[0]].dtype == np.uint8 if input_dq.input[0] in weights else True
        # Quantized whole, or (a group norm's SiLU) in channel parts concatenated as uint8 (norm_parts.py).
        made = made_by[input_dq.input[0]]
        parts = [made_by[i].op_type for i in made.input] if made.op_type == "Concat" else ["QuantizeLinear"]
        assert made.op_type in ("QuantizeLinear", "Concat") and set(parts) == {"QuantizeLinear"}, conv.name
    # Every group norm in parts (each LayerNormalization over a quarter of its groups), the RGB
    # conv's float input too.
    fusions = manifest["graphs"]["vae_decoder"]["fusions"]
    assert q["group_norms_in_parts"] == fusions["group_norms_as_layer_norms"] > 0, q
    norms = [n for n in model.graph.node if n.op_type == "LayerNormalization"]
    assert len(norms) == PARTS * q["group_norms_in_parts"]
    assert {int(weights[made_by[n.input[0]].input[1]][1]) for n in norms} == {8 // PARTS}  # tiny: 8 groups
    assert made_by[rgb[0].input[0]].op_type == "Concat"
    # What the CPU provider makes of it: integer convolutions.
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(bundle / "optimized.onnx.tmp")
    try:
        ort.InferenceSession(str(bundle / spec["file"]), opts, providers=["CPUExecutionProvider"])
        optimized = onnx.load(opts.optimized_model_filepath).graph.node
    finally:
        Path(opts.optimized_model_filepath).unlink(missing_ok=True)
    ops = collections.Counter(n.op_type for n in optimized)
    assert (ops["QLinearConv"], ops["Conv"]) == (q["quantized_nodes"], 1), ops
    # The upsamplers' phases (upsample_convs.py) are concatenated and interleaved on uint8.
    upsamplers = manifest["graphs"]["vae_decoder"]["fusions"]["upsamplers_as_phase_convs"]
    assert upsamplers == 3 and (ops["QLinearConcat"], ops["DepthToSpace"], ops["Resize"]) == (3, 3, 0), ops
    made_by = {o: n for n in optimized for o in n.output}

    def source(name):  # the node making `name`, past the layout Transposes ONNX Runtime adds
        node = made_by[name]
        return source(node.input[0]) if node.op_type == "Transpose" else node.op_type

    assert [source(n.input[0]) for n in optimized if n.op_type == "DepthToSpace"] == ["QLinearConcat"] * 3
    # No float copy of a convolution's output is made for a Shape alone (quantize._shapes_of_codes):
    # the group norms' Shapes read the uint8 codes, in the file and in the optimised graph.
    read_by = collections.defaultdict(set)
    for node in optimized:
        for name in node.input:
            read_by[name].add(node.op_type)
    only_shaped = [n.name for n in optimized if n.op_type == "DequantizeLinear" and read_by[n.output[0]] == {"Shape"}]
    assert not only_shaped, only_shaped
    made_in_file = {o: n for n in model.graph.node for o in n.output}
    shapes = [n for n in model.graph.node if n.op_type == "Shape" and n.input[0] in made_in_file]
    read = [made_in_file[n.input[0]] for n in shapes]
    read = [made_in_file.get(r.input[0], r) if r.op_type == "Reshape" else r for r in read]
    assert shapes and "DequantizeLinear" not in {r.op_type for r in read}, collections.Counter(r.op_type for r in read)
    onnx.checker.check_model(model, full_check=True)  # the Reshapes added for the Shapes included


def test_quantization_takes_the_components_its_method_covers(tiny_checkpoint, tiny_bundle, tmp_path, capsys):
    """MatMulNBits and dynamic take the text encoder and transformer; static the VAE decoder only; the
    VAE encoder nothing. Each refusal says why and writes nothing."""
    for name in ("vae", "vae_encoder"):
        with pytest.raises(QuantizationError, match="the VAE encoder is never quantized"):
            parse_components(f"transformer,{name}")
        with pytest.raises(QuantizationError, match="the VAE encoder is never quantized"):
            QuantizationConfig(bits=8, method="QDQ", components=(name,))
    with pytest.raises(QuantizationError, match="quantized with --method static only"):
        QuantizationConfig(bits=8, components=("vae_decoder",))
    with pytest.raises(QuantizationError, match="--method static is for the VAE decoder"):
        QuantizationConfig(bits=8, method="QDQ", components=("transformer",))
    with pytest.raises(QuantizationError, match="--method static quantizes to int8"):
        QuantizationConfig(bits=4, method="QDQ", components=("vae_decoder",))
    cases = [
        (["--quantize", "int4", "--components", "text_encoder,vae"], "the VAE encoder is never quantized"),
        (["--quantize", "int8", "--components", "vae_decoder"], "quantized with --method static only"),
        (["--quantize", "int8", "--method", "static", "--components", "text_encoder"], "for the VAE decoder"),
        (["--quantize", "int4", "--method", "static"], "--method static quantizes to int8"),
    ]
    for argv, message in cases:
        assert main(["convert", "--checkpoint", str(tiny_checkpoint), "--out", str(tmp_path / "c"), *argv]) == 2
        assert main(["quantize", "--bundle", str(tiny_bundle), "--out", str(tmp_path / "q"), *argv]) == 2
        assert capsys.readouterr().err.count(message) == 2, argv
    assert not any(tmp_path.iterdir()), "nothing written"


# The bundles whose graphs run ONNX Runtime's u8 x s8 int8 kernels (`int8` is MatMulNBits: float compute).
U8S8 = ("int8-dynamic", "int8-static", "int8-7bit")


def _cases(*names):
    """`names` as parameters, those of U8S8 marked `int8_kernels`."""
    return [pytest.param(n, marks=pytest.mark.int8_kernels) if n in U8S8 else n for n in names]


@pytest.mark.parametrize("name", _cases("fp16", "int8", "int4", "int8-dynamic", "int8-static", "int8-7bit"))
def test_component_errors_within_tolerance(tiny_checkpoint, bundles, name):
    # The VAE graphs of int8/int4 bundles are the fp32 bundle's (test_quantized_manifest_and_metadata),
    # the text encoder and transformer of the static one too (test_static_manifest_and_graphs).
    all_three = ("text_encoder", "transformer", "vae")
    components = {"fp16": all_three, "int8-static": ("vae",), "int8-7bit": all_three}.get(name, QUANTIZED)
    results = list(verify(tiny_checkpoint, bundles[name], components))
    print("\n".join(r.line() for r in results))
    everything, vae = set(COMPONENTS), {"vae_encoder", "vae_decoder"}
    expected = {"fp16": everything, "int8-static": vae, "int8-7bit": everything}.get(name, set(QUANTIZED))
    assert {r.component for r in results} == expected
    failed = [r.line() for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    if name in ("int8-static", "int8-7bit"):
        # The decoder is held to its PSNR rule; the encoder, not quantized, to the fp32 one.
        assert all((r.psnr is not None) == (r.component == "vae_decoder") for r in results if r.component in vae)
    if name not in ("fp16", "int8-static"):
        # The strong check: the quantized graphs compute the float32 model with dequantized weights
        # (for int8-7bit: the codes in [-64, 64] it wrote).
        assert all(r.emulated_abs is not None for r in results if r.component in QUANTIZED)


@pytest.mark.parametrize("name", _cases("fp32", "fp16", "int8", "int4", "int8-dynamic", "int8-static", "int8-7bit"))
def test_end_to_end_psnr(tiny_checkpoint, tiny_bundle, bundles, name):
    bundle = tiny_bundle if name == "fp32" else bundles[name]
    (result,) = verify_images(tiny_checkpoint, bundle, cases=IMAGE_CASES[:1])
    print(result.line())
    key = {"int8": 8, "int4": 4, "int8-7bit": "int8-dynamic"}.get(name, name)
    assert result.threshold == PSNR_THRESHOLD[key]
    assert result.ok, result.line()


def test_bundle_sizes(tiny_bundle, bundles):
    sizes = {"fp32": tiny_bundle, **bundles}
    sizes = {name: {p.name: p.stat().st_size for p in bundle.glob("*.onnx*")} for name, bundle in sizes.items()}
    for name, files in sizes.items():
        print(
            f"{name}: {sum(files.values()) / 1e6:.2f} MB in graphs  "
            + "  ".join(f"{k} {v / 1e6:.2f}" for k, v in sorted(files.items()))
        )
    assert sizes["int4"]["transformer.onnx"] < sizes["int8"]["transformer.onnx"] < sizes["fp32"]["transformer.onnx"]
    assert sizes["fp16"]["transformer.onnx"] < sizes["fp32"]["transformer.onnx"]
    assert sizes["int8"]["vae_decoder.onnx"] == sizes["fp32"]["vae_decoder.onnx"], "the VAE is not quantized"
    # The static decoder's weights are int8. Its file also holds the group norms' parts (norm_parts.py:
    # about 10 kB of nodes and constants per norm, 0.2 MB here, where the weights are 1 MB in float;
    # 0.4% of the wide decoder's file), so the weights' bytes are compared.
    weights = {
        name: sum(t.ByteSize() for t in onnx.load(str(bundle / "vae_decoder.onnx")).graph.initializer)
        for name, bundle in (("fp32", tiny_bundle), ("int8-static", bundles["int8-static"]))
    }
    assert weights["int8-static"] < weights["fp32"] / 2, weights


def test_bf16_is_refused_with_the_reason(tiny_checkpoint, tmp_path, capsys):
    reason = bfloat16_support()
    assert reason is not None, "ONNX Runtime's CPU provider now runs bf16 MatMul: revisit the bf16 refusal"
    with pytest.raises(PrecisionError, match="bf16 is refused.*CPU provider.*use --precision fp16"):
        convert(tiny_checkpoint, tmp_path / "bf16", precision="bf16")
    assert (
        main(["convert", "--checkpoint", str(tiny_checkpoint), "--out", str(tmp_path / "bf16"), "--precision", "bf16"])
        == 2
    )
    assert "NOT_IMPLEMENTED" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_quantize_refuses_a_quantized_graph_and_bad_options(int8_bundle, tmp_path):
    with pytest.raises(QuantizationError, match="already quantized"):
        quantize_copy(int8_bundle, tmp_path / "twice", QuantizationConfig(bits=4))
    assert not any(tmp_path.iterdir()), "no partial bundle left behind"
    for bad in ({"block_size": 24}, {"block_size": 8}, {"accuracy_level": 7}):
        with pytest.raises(QuantizationError):
            QuantizationConfig(bits=8, **bad)
    assert main(["quantize", "--bundle", str(int8_bundle), "--out", str(tmp_path / "x")]) == 2  # no --quantize


def test_large_quantized_graph_goes_to_external_data(tiny_checkpoint, tiny_bundle, tmp_path, monkeypatch):
    # The 2 GB protobuf limit, lowered so that the tiny transformer crosses it.
    monkeypatch.setattr("klein_export.quantize.EXTERNAL_DATA_THRESHOLD", 100_000)
    out = quantize_copy(
        tiny_bundle, tmp_path / "ext", QuantizationConfig(bits=4, components=("transformer",)), log=lambda _: None
    )
    manifest = _manifest(out)
    _check_files(out, manifest)
    assert "transformer.onnx.data" in manifest["files"]
    assert manifest["graphs"]["text_encoder"]["quantization"] is None
    results = list(verify(tiny_checkpoint, out, ("transformer",)))
    assert all(r.ok for r in results), "\n".join(r.line() for r in results)


@pytest.mark.parametrize("threshold", [None, 100_000])
def test_dynamic_reads_and_writes_external_weights_one_at_a_time(
    dynamic_bundle, tiny_bundle, tmp_path, monkeypatch, threshold
):
    """`--method dynamic` on a graph whose weights are in a `.onnx.data` file (the 4B's case: read one
    weight at a time, never the whole file) gives the same graph as on the in-memory one, whether the
    result goes back to external data (`threshold`: protobuf's 2 GB limit, lowered) or into the graph."""
    if threshold:
        monkeypatch.setattr("klein_export.quantize.EXTERNAL_DATA_THRESHOLD", threshold)
    path = tmp_path / "transformer.onnx"
    model = onnx.load(str(tiny_bundle / "transformer.onnx"))
    onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)
    assert len(onnx.load(str(path), load_external_data=False).graph.initializer[0].external_data) > 0
    scheme = quantize_graph(path, QuantizationConfig(bits=8, method=DYNAMIC))
    assert scheme["quantized_nodes"] == CUT_PRODUCTS["transformer"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["transformer.onnx"] + ["transformer.onnx.data"] * bool(
        threshold
    )
    got, want = onnx.load(str(path)), onnx.load(str(dynamic_bundle / "transformer.onnx"))
    assert [(n.op_type, list(n.input), list(n.output)) for n in got.graph.node] == [
        (n.op_type, list(n.input), list(n.output)) for n in want.graph.node
    ]
    want_weights = {i.name: onnx.numpy_helper.to_array(i) for i in want.graph.initializer}
    got_weights = {i.name: onnx.numpy_helper.to_array(i) for i in got.graph.initializer}
    assert got_weights.keys() == want_weights.keys()
    for name, values in want_weights.items():
        assert got_weights[name].dtype == values.dtype and np.array_equal(got_weights[name], values), name
    external = [i for i in onnx.load(str(path), load_external_data=False).graph.initializer if i.external_data]
    assert bool(external) == bool(threshold)


def test_activation_ranges_are_measured(tiny_checkpoint):
    ranges = measure_ranges(tiny_checkpoint, steps=2, size=64)
    by_name = {(r.component, r.name): r for r in ranges}
    # The residual stream (block outputs), the softmax inputs and the timestep argument are all seen.
    assert by_name[("transformer", "transformer_blocks.0")].max_out > 0
    assert by_name[("transformer", "<attention logits>")].max_out > 0
    assert by_name[("text_encoder", "<attention logits>")].max_out > 0
    assert by_name[("transformer", "time_guidance_embed.time_proj")].max_in > 500  # sigma * 1000
    assert {r.component for r in ranges} == {"text_encoder", "transformer", "vae"}
    lines = summarise_ranges(ranges, top=10)
    print("\n".join(lines))
    # Random weights stay far inside the float16 range (onnx/README.md, "Precision and quantization").
    assert max(max(r.max_in, r.max_out) for r in ranges) < FLOAT16_MAX / 10


def test_verify_against_the_fp32_bundle(tiny_bundle, bundles, capsys):
    """`verify --against`: ORT against ORT, no torch. A bundle against itself differs by nothing; fp16
    differs a little and int8 more in the text encoder and transformer, never in the VAE (not
    quantized); the image passes the scheme's PSNR bar (tolerances.PSNR_THRESHOLD)."""
    same = {d.component: d for d in component_differences(tiny_bundle, tiny_bundle, 64, 64)}
    assert set(same) == set(COMPONENTS) and all(d.max_abs == 0 for d in same.values())
    assert image_difference(tiny_bundle, tiny_bundle, 64, 64).psnr == float("inf")
    fp16 = {d.component: d for d in component_differences(bundles["fp16"], tiny_bundle, 64, 64)}
    int8 = {d.component: d for d in component_differences(bundles["int8"], tiny_bundle, 64, 64)}
    for component in QUANTIZED:
        assert 0 < fp16[component].rms_rel < int8[component].rms_rel, component
    assert int8["vae_decoder"].max_abs == 0 and int8["vae_encoder"].max_abs == 0
    assert 0 < fp16["vae_decoder"].rms_rel < 1e-2
    assert main(["verify", "--bundle", str(bundles["int8"]), "--against", str(tiny_bundle), "--size", "64"]) == 0
    out = capsys.readouterr().out
    assert out.count("rms_rel") == 4 and "fp32+int8 PSNR" in out and "(min 24)" in out
    assert main(["verify", "--bundle", str(bundles["int8"])]) == 2, "no checkpoint and no --against"


def test_verify_against_images_only(tiny_bundle, capsys):
    """`--images-only` with `--against`: the final image alone, no per-component errors."""
    assert (
        main(["verify", "--bundle", str(tiny_bundle), "--against", str(tiny_bundle), "--images-only", "--size", "64"])
        == 0
    )
    out = capsys.readouterr().out
    assert "rms_rel" not in out and "PSNR    inf dB against the reference bundle" in out, out


@pytest.mark.parametrize("name", ["int8", "int4", "int8-dynamic", "int8-static", "int8-7bit"])
def test_cpu_cache_keeps_quantized_images(bundles, name, tmp_path):
    """`klein generate --cpu-cache`: the first run saves each graph with its prepacked quantized
    weights, the second maps them; both images equal the one made without the cache, byte for byte."""
    args = ("a lantern", "--width", "64", "--height", "48", "--seed", "6", "--device", "cpu", "--threads", "1")
    cache = tmp_path / "cpu-cache"
    outputs = []
    for i, extra in enumerate([(), ("--cpu-cache", str(cache)), ("--cpu-cache", str(cache))]):
        out = tmp_path / f"{i}.png"
        cmd = [str(KLEIN), "generate", "--model", str(bundles[name]), "-o", str(out), "--quiet", *args, *extra]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        # Nothing to warn about but, on CPUs without VNNI, the 8-bit codes' slower kernels.
        warnings = [line for line in done.stderr.lower().splitlines() if "warning" in line]
        assert all("has no vnni" in line for line in warnings), done.stderr
        outputs.append(np.asarray(Image.open(out)))
    assert all(np.array_equal(outputs[0], o) for o in outputs[1:])
    saved = {p.name: p.with_name(p.name + ".data").stat().st_size for p in cache.glob("*/*.onnx")}
    assert sorted(saved) == ["text_encoder.onnx", "transformer.onnx", "vae_decoder.onnx"]
    # The prepacked weights are saved beside the bundle's own: one blob or more for each of the
    # transformer's products with a constant second operand (ONNX Runtime 1.31 packs none of 8-bit
    # MatMulNBits at accuracy level 0: it dequantizes them as it runs), none for the per-image
    # projections, whose weight comes first (ort_fusions.weight_first_vector_products).
    model = onnx.load(str(next(cache.glob("*/transformer.onnx"))), load_external_data=False)
    packed = {i.name for i in model.graph.initializer if any(e.key.startswith("prepacked") for e in i.external_data)}
    weights = {i.name for i in model.graph.initializer}
    first = {n.input[0] for n in model.graph.node if "MatMul" in n.op_type and n.input[0] in weights}
    assert len(packed) >= (0 if name == "int8" else MATMUL_WEIGHTS["transformer"]), packed
    assert len(first) == 6 and not packed & first, (packed, first)


@pytest.mark.parametrize(
    "name, huge_pages", [("fp16", True), ("int8-static", True), ("int8-dynamic", False), ("int8", False)]
)
def test_huge_pages_only_for_float_transformers(bundles, name, huge_pages):
    """`klein generate` without VAE tiles asked for (auto's included) starts itself
    again with glibc's transparent huge pages (src/bin/klein/heap.rs) where the bundle's transformer is
    float (fp16; the static scheme quantizes only the VAE decoder), not where it is quantized (no gain
    measured there), and only where the kernel gives huge pages on request; `--timings` says the
    heap's setting."""
    args = ("a lantern", "--width", "64", "--height", "48", "--seed", "6", "--steps", "1", "--timings")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(KLEIN), "generate", "--model", str(bundles[name]), "-o", f"{tmp}/out.png", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    heap = [line.split(":", 1)[1].strip() for line in done.stderr.splitlines() if line.strip().startswith("heap:")]
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = mode.read_text() if mode.exists() else ""
    kernel_gives = platform.libc_ver()[0] == "glibc" and ("[always]" in mode or "[madvise]" in mode)
    if huge_pages and kernel_gives:
        kept = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184"
        assert heap == [f"GLIBC_TUNABLES=glibc.malloc.hugetlb=1:{kept}"], done.stderr
    elif platform.libc_ver()[0] == "glibc":
        assert heap == ["freed memory kept (mallopt)"], done.stderr
    else:
        assert heap == ["the allocator's defaults"], done.stderr


@pytest.mark.int8_kernels
def test_dynamic_text_encoder_computes_the_same_unpacked(bundles):
    """The runtime loads a dynamic-int8 text encoder that it releases after the prompt without
    prepacking (`pipeline/graphs.rs::prepacks`): that holds only while DynamicQuantizeMatMul gives the
    same result, to the last bit, with its weights packed at load or at each run."""
    import onnxruntime as ort

    path = str(bundles["int8-dynamic"] / "text_encoder.onnx")
    feeds = {
        "input_ids": np.random.default_rng(3).integers(0, 1000, (1, 40)).astype(np.int64),
        "attention_mask": (np.arange(40) < 29).astype(np.int64)[None],
    }
    outputs = []
    for disable in ("0", "1"):
        options = session_options(threads=2)
        options.add_session_config_entry("session.disable_prepacking", disable)
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        outputs.append(session.run(None, feeds)[0])
    assert "DynamicQuantizeMatMul" in {n.op_type for n in onnx.load(path, load_external_data=False).graph.node}
    assert np.array_equal(outputs[0], outputs[1])


@pytest.mark.int8_kernels
def test_emulation_quantizes_key_projections_over_the_rows_the_graph_computes(tiny_checkpoint, dynamic_bundle):
    """An int8 `--method dynamic` text encoder projects keys and values from the rows up to the batch's
    last real token only, so their activations' range is those rows' (real_keys.py); verify's torch
    emulation must do the same. Layer 0's key projection of a right-padded batch (21 and 9 real
    tokens of 64) from ONNX Runtime against the emulation: equal to float32 rounding (1e-4 on outputs
    of order 1: one product of 16 terms), and the range of all 64 rows would give another product."""
    import torch
    from transformers import AutoModelForCausalLM

    from klein_export.checkpoint import Checkpoint
    from klein_export.quantize import emulate_quantization, quantized_activations
    from klein_export.wrappers import TextEncoder

    spec = _manifest(dynamic_bundle)["graphs"]["text_encoder"]
    assert spec["fusions"]["key_projections_trimmed"] > 0
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 150000, (2, 64)).astype(np.int64)
    mask = np.stack([np.arange(64) < 21, np.arange(64) < 9]).astype(np.int64)
    model = onnx.load(str(dynamic_bundle / spec["file"]))
    made_by = {out: node for node in model.graph.node for out in node.output}
    products = [n for n in model.graph.node if n.op_type == "DynamicQuantizeMatMul"]
    key = next(n.output[0] for n in products if made_by[n.input[0]].op_type == "Slice")
    model.graph.output.append(onnx.helper.make_tensor_value_info(key, TensorProto.FLOAT, None))
    session = cpu_session(model.SerializeToString())
    (got,) = session.run([key], {"input_ids": ids, "attention_mask": mask})
    assert got.shape[1] == 21

    encoder = TextEncoder(
        AutoModelForCausalLM.from_pretrained(tiny_checkpoint / "text_encoder"),
        Checkpoint(tiny_checkpoint).text_encoder_out_layers,
    )
    args = (torch.from_numpy(ids), torch.from_numpy(mask))
    emulate_quantization(encoder, spec["quantization"], args, key_rows=True)
    seen = {}
    k_proj = encoder.model.layers[0].self_attn.k_proj
    # the input before the emulation's own pre-hook quantizes it, and the output
    k_proj.register_forward_pre_hook(lambda _m, inputs: seen.update(x=inputs[0]), prepend=True)
    k_proj.register_forward_hook(lambda _m, _inputs, out: seen.update(k=out))
    with torch.no_grad():
        encoder(*args)
        whole = torch.nn.functional.linear(quantized_activations(seen["x"]), k_proj.weight)
    assert np.abs(seen["k"][:, :21].numpy() - got).max() < 1e-4
    # With all 64 rows' range the product moves by more than rounding: the check above tells them apart.
    assert np.abs(whole[:, :21].numpy() - got).max() > 1e-3
