"""The transformer's per-image projections as MatMul with the weight first
(ort_fusions.weight_first_vector_products): the same products, and ONNX Runtime keeps the order, so
that it never prepacks those weights."""

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from klein_export.ort_fusions import weight_first_vector_products

K, N = 24, 40


def _model(nodes, inits, n=N):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


def _weight(name, rows, cols, seed=0):
    return numpy_helper.from_array(np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32), name)


def _gemm_model(**attrs):
    """y = Gemm(x [B, K], W [N, K], attrs), with a bias `c [N]` when `attrs` has `bias`."""
    bias = attrs.pop("bias", False)
    inits = [_weight("w", N, K)]
    inputs = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(np.ones(N, np.float32), "c"))
        inputs.append("c")
    return _model([helper.make_node("Gemm", inputs, ["y"], **attrs)], inits)


def _chained_model():
    """The transformer's timestep path: y = Gemm(SiLU(Gemm(x, W1)), W2), both with transB. Rewritten,
    ONNX Runtime cancels the transposes between the two products, so that the second one takes a
    `[K, B]` operand: a single column for one image."""
    silu = [helper.make_node("Sigmoid", ["h"], ["s"]), helper.make_node("Mul", ["h", "s"], ["a"])]
    nodes = [helper.make_node("Gemm", ["x", "w1"], ["h"], transB=1), *silu]
    nodes.append(helper.make_node("Gemm", ["a", "w2"], ["y"], transB=1))
    return _model(nodes, [_weight("w1", 256, K, 1), _weight("w2", N, 256, 2)])


def _run(model, x, optimized_path=None):
    options = ort.SessionOptions()
    if optimized_path:
        options.optimized_model_filepath = str(optimized_path)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _rewrite(model):
    ir_model = ir.serde.deserialize_model(model)
    counts = weight_first_vector_products(ir_model)
    return ir.serde.serialize_model(ir_model), counts


def test_rewritten_gemm_computes_the_same_product_for_any_batch(tmp_path):
    """Gemm(x, W, transB=1) and its rewrite give the same [B, N] for one and three rows (float32
    rounding of a K=24 sum: the order of the products may differ, hence 1e-6 relative), and the graph
    keeps its input and output names."""
    model = _gemm_model(transB=1)
    rewritten, counts = _rewrite(model)
    assert counts == {"weight_first_vector_products": 1}
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops == ["Pad", "Transpose", "MatMul", "Transpose", "Slice"]
    assert [n.input[0] for n in rewritten.graph.node if n.op_type == "MatMul"] == ["w"]
    assert ([i.name for i in rewritten.graph.input], [o.name for o in rewritten.graph.output]) == (["x"], ["y"])
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, K)).astype(np.float32)
        expected = _run(model, x)
        got = _run(rewritten, x, tmp_path / f"optimized{batch}.onnx")
        assert got.shape == (batch, N)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_an_image_alone_equals_the_same_image_in_a_batch(tmp_path):
    """Each row of a batch equals the same row computed alone, to the bit, through two chained
    products (the zero row keeps ONNX Runtime on its matrix product for one row too; without it
    the second product of one row is a matrix-vector product, which rounds differently). And the
    result is the Gemm graph's to float32 rounding."""
    model = _chained_model()
    rewritten, counts = _rewrite(model)
    assert counts == {"weight_first_vector_products": 2}
    x = np.random.default_rng(5).standard_normal((3, K)).astype(np.float32)
    batch = _run(rewritten, x, tmp_path / "optimized.onnx")
    for row in range(3):
        alone = _run(rewritten, x[row : row + 1])
        assert np.array_equal(alone[0], batch[row]), row
    np.testing.assert_allclose(batch, _run(model, x), rtol=1e-5, atol=1e-5)


def test_onnx_runtime_keeps_the_weight_first(tmp_path):
    """ONNX Runtime's optimiser (all levels, as a CPU session saves it) writes no Gemm and no product
    that takes the weight as its second operand, the one it would prepack."""
    rewritten, _ = _rewrite(_gemm_model(transB=1))
    _run(rewritten, np.ones((2, K), np.float32), tmp_path / "optimized.onnx")
    optimized = onnx.load(str(tmp_path / "optimized.onnx"))
    products = [n for n in optimized.graph.node if n.op_type in ("Gemm", "MatMul", "FusedMatMul")]
    assert [n.op_type for n in products] != [] and "Gemm" not in [n.op_type for n in products]
    assert all(n.input[0] == "w" and "w" not in n.input[1:] for n in products)


def test_other_gemms_are_left_alone():
    """A bias, a scale, transA or an untransposed weight: not the exporter's per-image projection,
    left as written."""
    for attrs in ({"transB": 1, "bias": True}, {"transB": 1, "alpha": 2.0}, {"transA": 1, "transB": 1}, {}):
        model = _gemm_model(**dict(attrs))
        rewritten, counts = _rewrite(model)
        assert counts == {} and [n.op_type for n in rewritten.graph.node] == ["Gemm"], attrs
