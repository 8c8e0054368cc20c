"""The VAE's mid-block attention in query slices (sliced_attention.py): the pass keeps what the graph
computes (numpy's attention on a synthetic graph, at sizes below, at and above the slice count, and
not divisible by it), and both VAE graphs of an exported bundle carry it (their outputs against torch
are test_export.py's `test_every_component_matches_torch`).

Tolerance: 1e-6 absolute on softmax-weighted averages of values in [-1, 1]: float32 rounding of two
products of 16 terms each (the slices run the same kernels on fewer rows).
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from klein_export.sliced_attention import SLICES, slice_attention


def attention_graph() -> onnx.ModelProto:
    """`softmax(q @ kT) @ v` over `[1, 1, S, 16]` inputs, as the exporter writes the VAE's."""
    dims = [1, 1, "S", 16]
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, dims),
        helper.make_tensor_value_info("kT", TensorProto.FLOAT, [1, 1, 16, "S"]),
        helper.make_tensor_value_info("v", TensorProto.FLOAT, dims),
    ]
    nodes = [
        helper.make_node("MatMul", ["q", "kT"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["attended"]),
        helper.make_node("Relu", ["attended"], ["out"]),
    ]
    out = [helper.make_tensor_value_info("out", TensorProto.FLOAT, dims)]
    graph = helper.make_graph(nodes, "attention", inputs, out)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


@pytest.mark.parametrize("cells", [1, SLICES - 1, SLICES, 3 * SLICES + 5])
def test_slices_compute_the_whole_attention(cells):
    model = attention_graph()
    assert slice_attention(model) == 1
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert (ops.count("Split"), ops.count("Softmax"), ops.count("MatMul")) == (1, SLICES, 2 * SLICES)
    rng = np.random.default_rng(cells)
    q, v = (rng.uniform(-1, 1, (1, 1, cells, 16)).astype(np.float32) for _ in range(2))
    k_t = rng.uniform(-1, 1, (1, 1, 16, cells)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"q": q, "kT": k_t, "v": v})
    scores = q.astype(np.float64) @ k_t
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.maximum((probs / probs.sum(-1, keepdims=True)) @ v, 0)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-6


def test_other_softmaxes_are_left_alone():
    """A softmax whose scores are also a graph output (or used twice) is not an attention chain."""
    model = attention_graph()
    model.graph.output.append(helper.make_tensor_value_info("scores", TensorProto.FLOAT, None))
    assert slice_attention(model) == 0


def test_both_vae_graphs_are_sliced(tiny_bundle):
    for name in ("vae_encoder.onnx", "vae_decoder.onnx"):
        nodes = onnx.load(str(tiny_bundle / name)).graph.node
        sliced = [n.op_type for n in nodes if n.name.startswith("klein_sliced_attention_0/")]
        assert (sliced.count("Split"), sliced.count("Softmax")) == (1, SLICES), name
        assert [n.op_type for n in nodes].count("Softmax") == SLICES, name
