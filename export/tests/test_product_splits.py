"""`--method dynamic` computes a product whose output is only cut into column ranges as one product per
range (product_splits.py): the same outputs, bit for bit, without the cuts' copies."""

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from klein_export.int8_kernels import cpu_session
from klein_export.product_splits import GraphUses, Part, Piece, column_pieces, input_parts
from klein_export.quantize import DYNAMIC, QuantizationConfig, per_channel_int8, quantize_graph

K, N = 32, 40
RNG = np.random.default_rng(3)
WEIGHT = RNG.standard_normal((K, N)).astype(np.float32)


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _cut_graph(product_op="MatMul", extra_inputs=()):
    """x [2, 5, K] . W [K, N] -> Split [16, 24] on the last axis; the 24 -> Slice [0:12] and Slice [12:];
    the 16 -> Split into 2 equal parts (num_outputs); every part an output. The structure of a single
    block's q/k/v/MLP projection."""
    nodes = [
        helper.make_node(product_op, ["x", *extra_inputs], ["y"], domain="com.microsoft" if extra_inputs else ""),
        helper.make_node("Split", ["y", "sizes"], ["qkv", "mlp"], axis=2),
        helper.make_node("Split", ["qkv"], ["q", "k"], axis=-1, num_outputs=2),
        helper.make_node("Slice", ["mlp", "zero", "twelve", "last"], ["gate"]),
        helper.make_node("Slice", ["mlp", "twelve", "end", "last", "one"], ["up"]),
    ]
    inits = [
        _ints("sizes", [16, 24]),
        _ints("zero", [0]),
        _ints("twelve", [12]),
        _ints("end", [np.iinfo(np.int64).max]),
        _ints("last", [2]),
        _ints("one", [1]),
    ]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 5, w]) for n, w in [("q", 8), ("k", 8)]]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 5, 12]) for n in ("gate", "up")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, K])
    graph = helper.make_graph(nodes, "cuts", [x], outputs, inits)
    graph.value_info.extend([helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, N])])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def test_cuts_are_planned_as_pieces():
    model = _cut_graph()
    model.graph.initializer.append(numpy_helper.from_array(WEIGHT, "w"))
    model.graph.node[0].input.append("w")
    pieces, cuts = column_pieces(GraphUses(model.graph, Path()), "y", N)
    assert sorted(pieces, key=lambda p: p.start) == [
        Piece("q", 0, 8),
        Piece("k", 8, 16),
        Piece("gate", 16, 28),
        Piece("up", 28, 40),
    ]
    assert sorted(n.op_type for n in cuts) == ["Slice", "Slice", "Split", "Split"]


def test_a_product_read_whole_or_cut_otherwise_is_not_split():
    model = _cut_graph()
    graph = model.graph
    graph.node.append(helper.make_node("Relu", ["mlp"], ["r"]))  # the 24 is also read whole
    pieces, cuts = column_pieces(GraphUses(graph, Path()), "y", N)
    assert Piece("mlp", 16, 40) in pieces and Piece("q", 0, 8) in pieces and len(pieces) == 3
    graph.node[3].input[3] = "zero"  # a Slice of the first axis: not a column range
    graph.node.pop()
    pieces, _ = column_pieces(GraphUses(graph, Path()), "y", N)
    assert Piece("mlp", 16, 40) in pieces
    overlapping = _cut_graph()
    overlapping.graph.node[4].input[1] = "zero"  # gate [0:12] and up [0:] of the 24 overlap
    assert column_pieces(GraphUses(overlapping.graph, Path()), "y", N) is None


@pytest.mark.int8_kernels
def test_split_products_give_the_same_outputs(tmp_path):
    """Quantized with the cuts planned, against the whole product quantized the same way (int8 codes and
    scales per output channel) followed by the cuts: equal bit for bit in ONNX Runtime."""
    path = tmp_path / "cuts.onnx"
    model = _cut_graph()
    model.graph.initializer.append(numpy_helper.from_array(WEIGHT, "w"))
    model.graph.node[0].input.append("w")
    onnx.save(model, str(path))
    scheme = quantize_graph(path, QuantizationConfig(bits=8, method=DYNAMIC))
    split = onnx.load(str(path))
    assert scheme["quantized_nodes"] == 4 and {n.op_type for n in split.graph.node} == {DYNAMIC}
    assert {i.name for i in split.graph.initializer} == {
        f"{n.name}_{part}" for n in split.graph.node for part in ("codes", "scale", "zero")
    }, "the cuts' constants and the float weight are gone"

    codes, scale = per_channel_int8(WEIGHT)
    whole = _cut_graph(DYNAMIC, ["codes", "scale", "zero_points"])
    whole.graph.initializer.extend(
        [
            numpy_helper.from_array(codes, "codes"),
            numpy_helper.from_array(scale, "scale"),
            numpy_helper.from_array(np.zeros(N, np.int8), "zero_points"),
        ]
    )
    x = {"x": RNG.standard_normal((2, 5, K)).astype(np.float32) * 3}
    names = ["q", "k", "gate", "up"]
    got = cpu_session(path).run(names, x)
    want = cpu_session(whole.SerializeToString()).run(names, x)
    for name, g, w in zip(names, got, want, strict=True):
        assert np.array_equal(g, w), name


def test_split_nbits_products_give_the_same_outputs(tmp_path):
    """MatMulNBits (blocks along K within a column): the pieces against the whole product quantized by
    the same quantizer (kept whole because its output is also a graph output), equal bit for bit."""
    got = {}
    for whole in (False, True):
        path = tmp_path / f"{whole}.onnx"
        model = _cut_graph()
        model.graph.initializer.append(numpy_helper.from_array(WEIGHT, "w"))
        model.graph.node[0].input.append("w")
        if whole:
            model.graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, N]))
        onnx.save(model, str(path))
        scheme = quantize_graph(path, QuantizationConfig(bits=4, block_size=16))
        ops = [n.op_type for n in onnx.load(str(path)).graph.node]
        assert (scheme["quantized_nodes"], scheme["quantized_weights"]) == ((1, 1) if whole else (4, 1)), ops
        x = {"x": np.linspace(-3, 3, 2 * 5 * K, dtype=np.float32).reshape(2, 5, K)}
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got[whole] = session.run(["q", "k", "gate", "up"], x)
    for g, w in zip(got[False], got[True], strict=True):
        assert np.array_equal(g, w)


def _concat_graph(widths, also_output=False):
    """Inputs a [2, 5, widths[0]] and b [2, 5, widths[1]] -> Concat on the last axis -> . W [K, N] -> y.
    The structure of a single block's `to_out` (attention output beside the SwiGLU output)."""
    nodes = [
        helper.make_node("Concat", ["a", "b"], ["ab"], axis=-1),
        helper.make_node("MatMul", ["ab", "w"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 5, w]) for n, w in zip("ab", widths, strict=True)]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, N])]
    if also_output:
        outputs.append(helper.make_tensor_value_info("ab", TensorProto.FLOAT, [2, 5, K]))
    graph = helper.make_graph(nodes, "parts", inputs, outputs, [numpy_helper.from_array(WEIGHT, "w")])
    graph.value_info.append(helper.make_tensor_value_info("ab", TensorProto.FLOAT, [2, 5, K]))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_a_concatenated_input_is_planned_as_parts():
    graph = _concat_graph([8, 24]).graph
    parts, concat = input_parts(GraphUses(graph, Path()), "ab", K, 8)
    assert parts == [Part("a", 0, 8), Part("b", 8, 32)] and concat.op_type == "Concat"
    assert input_parts(GraphUses(graph, Path()), "ab", K, 16) is None, "b starts inside a 16-row block"
    assert input_parts(GraphUses(_concat_graph([8, 24], also_output=True).graph, Path()), "ab", K, 1) is None
    graph.node[0].attribute[0].i = 1  # a Concat of the token axis: no parts of K
    assert input_parts(GraphUses(graph, Path()), "ab", K, 1) is None


@pytest.mark.int8_kernels
def test_dynamic_parts_quantize_each_part_on_its_own(tmp_path):
    """`--method dynamic`: one DynamicQuantizeMatMul per part on the whole weight's rows (codes and
    scales per output channel of the whole), summed: what the torch emulation computes (each part's
    activations quantized with its own range) to float32 rounding, and nearer the float product
    than quantizing the concatenation as one tensor."""
    import torch

    from klein_export.quantize import _in_parts, dequantized, quantized_activations

    path = tmp_path / "parts.onnx"
    onnx.save(_concat_graph([24, 8]), str(path))
    config = QuantizationConfig(bits=8, method=DYNAMIC)
    scheme = quantize_graph(path, config)
    ops = sorted(n.op_type for n in onnx.load(str(path)).graph.node)
    assert ops == ["Add", DYNAMIC, DYNAMIC] and (scheme["quantized_weights"], scheme["split_inputs"]) == (1, 1)
    # The attention output's range is a tenth of the SwiGLU output's, as the parts' ranges differ in a block.
    a = RNG.standard_normal((2, 5, 24)).astype(np.float32) * 0.3
    b = RNG.standard_normal((2, 5, 8)).astype(np.float32) * 3
    got = cpu_session(path).run(["y"], {"a": a, "b": b})[0]
    x, w = torch.from_numpy(np.concatenate([a, b], -1)), torch.from_numpy(dequantized(WEIGHT, config))
    emulated = (_in_parts(x, (24, 8)) @ w).numpy()
    # int32 accumulations, then float32 scaling against float32 sums of ~32 terms of size ~10: 1e-4.
    np.testing.assert_allclose(got, emulated, rtol=0, atol=1e-4)
    # The activations' error alone (the same int8 weights): a's step, on 24 of the 32 rows, is a tenth
    # of the concatenation's; the error's spread about sqrt((8 + 24 / 100) / 32) = 0.51 of the whole's.
    exact, whole = (x @ w).numpy(), (quantized_activations(x) @ w).numpy()
    assert np.abs(got - exact).mean() < 0.8 * np.abs(whole - exact).mean()


def test_nbits_parts_give_the_whole_product(tmp_path):
    """MatMulNBits with parts on block boundaries: the same blocks as the whole weight's; only the
    order of the float sum changes (the whole kept by also reading the concatenation)."""
    got = {}
    for whole in (False, True):
        path = tmp_path / f"{whole}.onnx"
        onnx.save(_concat_graph([16, 16], also_output=whole), str(path))
        scheme = quantize_graph(path, QuantizationConfig(bits=4, block_size=16, accuracy_level=4))
        assert (scheme["quantized_nodes"], scheme["split_inputs"]) == ((1, 0) if whole else (2, 1))
        feeds = {
            n: np.linspace(-3, 3, 2 * 5 * 16, dtype=np.float32).reshape(2, 5, 16) * s for n, s in (("a", 1), ("b", -2))
        }
        got[whole] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["y"], feeds)[0]
    # Two float32 partial sums of ~16 products of size ~10 added in another order: 1e-4.
    np.testing.assert_allclose(got[False], got[True], rtol=0, atol=1e-4)
