"""`--method dynamic` computes a product whose output is only cut into column ranges as one product per
range (product_splits.py): the same outputs, bit for bit, without the cuts' copies."""

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from klein_export.product_splits import GraphUses, Piece, column_pieces
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
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(names, x)
    want = ort.InferenceSession(whole.SerializeToString(), providers=["CPUExecutionProvider"]).run(names, x)
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
