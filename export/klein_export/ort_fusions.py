"""Rewrites of exported graphs into ONNX Runtime's fused operators (`onnx_export.export_graph`'s
`fuse`): each takes an onnx_ir model, changes it in place and returns the count of each rewrite.
Static-shape (CoreML) bundles are exported without them: CoreML does not run these operators."""

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, ShapeInferencePass
from onnxscript.rewriter.ort_fusions import optimize_for_ort
from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization

from .real_keys import attend_to_real_keys_only
from .upsample_convs import upsamplers_as_phase_convs


def fuse_for_ort(model) -> dict:
    """Rewrites `model` (an onnx_ir model, in place) with ONNX Runtime's fused operators, by
    onnxscript's `optimize_for_ort`; returns the count of each fusion applied.

    On the Qwen3 text encoder it writes each RMSNorm as SimplifiedLayerNormalization (with the
    residual add before it, SkipSimplifiedLayerNormalization) and each attention as one
    MultiHeadAttention with the causal and padding mask as its additive bias. The exporter writes
    them otherwise as Pow-ReduceMean-Sqrt-Reciprocal-Mul chains, which ONNX Runtime does not fuse
    itself, and as MatMul-Softmax-MatMul with two `Where`s and an `IsNaN` over every head's
    [tokens, tokens] scores. The wide checkpoint's encoder at 512 tokens on an AMX host: 2.73 -> 2.14 s
    in int8, same output to float32 rounding (benches/RESULTS.md, "Fused operators")."""
    _, counts = optimize_for_ort(model)
    # ONNX's shape inference does not know SkipSimplifiedLayerNormalization: its output and residual
    # sum (outputs 0 and 3) are typed as its input, its unused statistics (1, 2) as float32, so that
    # the graph says every value's type.
    for node in model.graph:
        if node.op_type != "SkipSimplifiedLayerNormalization":
            continue
        for index, out in enumerate(node.outputs):
            if out.type is None and index in (0, 3):
                out.type, out.shape = node.inputs[0].type, node.inputs[0].shape
            elif out.type is None:
                out.type = ir.TensorType(ir.DataType.FLOAT)
    counts["attention_keys_trimmed"], counts["key_projections_trimmed"] = attend_to_real_keys_only(model)
    return {name: count for name, count in counts.items() if count}


def fuse_transformer(model) -> dict:
    """The transformer's rewrites (in place): its RMSNorms fused ([`fuse_rms_norms`]) and its
    per-image projections with the weight first ([`weight_first_vector_products`]); returns the
    count of each."""
    return {**fuse_rms_norms(model), **weight_first_vector_products(model)}


def weight_first_vector_products(model) -> dict:
    """Rewrites (in place) each `Gemm(x, W, transB=1)` of `model` with a constant weight `W [N, K]`
    and no bias as a product with the weight first, `W . [x; 0]^T`, the zero row dropped again: the
    same `[B, N]`; returns the count.

    In the transformer these are the projections of one vector per image (`x [B, K]`: the timestep
    embedder, the shift/scale/gate modulations and the final AdaLayerNorm; 171M of the wide and 4B
    checkpoints' weights, 683 MB in float32). ONNX Runtime's CPU provider prepacks a constant
    second operand (Gemm's or MatMul's `B`) when it creates a session, also from the CPU cache, and
    hashes every packed buffer; a product of one row gains nothing from packing. As the first
    operand the weight is read where it lies: the wide int8 transformer's session from the CPU cache
    in 0.83 s instead of 1.81 s, its steps as fast, and the packed copies gone (benches/RESULTS.md, "Load time:
    the per-image projections are not prepacked"). ONNX Runtime's optimiser keeps the order (it
    folds the transposes into its neighbours or into a FusedMatMul, never back into a Gemm).

    The zero row keeps the batch out of the sums: ONNX Runtime computes a product whose second
    operand has one column as a matrix-vector product, which rounds differently from the matrix
    product of two or more columns, so without it an image made alone would differ in its last bits
    from the same image made in a batch. With it the product has `B + 1 >= 2` columns whatever the
    batch, and each column's sums are the same."""
    constants = {}

    def const(name, values):  # one initializer per name, however many products use it
        if name not in constants:
            constants[name] = _int64s(model, name, values)
        return constants[name]

    count = 0
    for node in list(model.graph):
        if node.op_type != "Gemm" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        x, weight = node.inputs
        attrs = {name: attr.value for name, attr in node.attributes.items()}
        plain = attrs.get("transA", 0) == 0 and attrs.get("transB", 0) == 1 and attrs.get("alpha", 1.0) == 1.0
        if not plain or not weight.is_initializer() or weight.shape is None or len(weight.shape) != 2:
            continue
        one_row = const("klein_pad_one_row", [0, 0, 1, 0])
        padded = ir.Node("", "Pad", [x, one_row])  # [B, K] -> [B + 1, K], the last row 0
        x_t = ir.Node("", "Transpose", [padded.outputs[0]], [ir.AttrInt64s("perm", [1, 0])])  # [K, B + 1]
        product = ir.Node("", "MatMul", [weight, x_t.outputs[0]])  # [N, K] . [K, B + 1] -> [N, B + 1]
        y_t = ir.Node("", "Transpose", [product.outputs[0]], [ir.AttrInt64s("perm", [1, 0])])  # [B + 1, N]
        zero, last = const("klein_zero_", [0]), const("klein_minus_one", [-1])
        out = ir.Node("", "Slice", [y_t.outputs[0], zero, last, zero])  # rows 0..B: [B, N]
        ir.convenience.replace_nodes_and_values(
            model.graph, node, [node], [padded, x_t, product, y_t, out], node.outputs, out.outputs
        )
        count += 1
    return {"weight_first_vector_products": count} if count else {}


def fuse_rms_norms(model) -> dict:
    """Rewrites `model`'s RMSNorms (in place) as SimplifiedLayerNormalization; returns the count.

    For the transformer, where `optimize_for_ort` as a whole would also rewrite the Gemm nodes whose
    weights the LoRA targets name. torch.nn.RMSNorm (the transformer's query and key norms) exports
    its mean over the last axis as a positive axis, which onnxscript's rule does not recognise: those
    axes are written as -1 first."""
    last = None
    for node in model.graph:
        if node.op_type != "ReduceMean" or len(node.inputs) < 2 or node.inputs[0].shape is None:
            continue
        axes = node.inputs[1].const_value
        rank = len(node.inputs[0].shape)
        if axes is not None and axes.numpy().tolist() == [rank - 1]:
            if last is None:
                last = ir.Value(name="klein_last_axis", const_value=ir.tensor([-1], dtype=ir.DataType.INT64))
                model.graph.register_initializer(last)
            node.replace_input_with(1, last)
    ShapeInferencePass()(model)
    count = fuse_rms_normalization(model)
    RemoveUnusedNodesPass()(model)  # the replaced chains' constants
    return {"rms_normalization": count} if count else {}


def fuse_vae(model) -> dict:
    """The VAE graphs' rewrites: group norms as LayerNormalization (below) and the decoder's
    upsamplers as four 2x2 convolutions at the lower resolution (upsample_convs.py)."""
    return {**group_norms_as_layer_norms(model), **upsamplers_as_phase_convs(model)}


def group_norms_as_layer_norms(model) -> dict:
    """Rewrites (in place) the VAE's group norms as ONNX Runtime's LayerNormalization; returns the count.

    torch exports `GroupNorm(G, C)` over `x [N, C, H, W]` as Reshape `[N, G, -1]` ->
    InstanceNormalization (scale 1, bias 0) -> Reshape to `Shape(x)`, then the affine Mul and Add.
    ONNX Runtime's CPU InstanceNormalization runs on one thread; its LayerNormalization splits the
    rows between threads, and its mean and variance come out at least as close (benches/RESULTS.md, "Group norms
    as LayerNormalization"). The rewrite: Reshape `x` to `[N, G, C/G * H, W]` (constant shape: 0
    copies N and W), LayerNormalization over the last two axes (axis 2) with a scale of ones as
    large as one group (`Expand`, 1/G of the tensor), and Reshape back to `[N, C, H, W]` with the
    constant `[0, C, -1, 0]`. The scale's `Shape` reads the regrouped input; in a statically
    quantized decoder it reads the codes instead (`quantize._shapes_of_codes`: ONNX Runtime gives
    each consumer of a quantized value its own DequantizeLinear)."""
    ones = None
    count = 0
    for norm in list(model.graph):
        if norm.op_type != "InstanceNormalization" or norm.domain not in ("", "ai.onnx"):
            continue
        scale, bias = (ir.convenience.get_const_tensor(v) for v in norm.inputs[1:3])
        grouped = norm.inputs[0].producer()
        users = list(norm.outputs[0].uses())
        if scale is None or bias is None or grouped is None or grouped.op_type != "Reshape" or len(users) != 1:
            continue
        if len(list(grouped.outputs[0].uses())) != 1:
            continue
        back = users[0].node
        x = grouped.inputs[0]
        if back.op_type != "Reshape" or x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[1], int):
            continue
        if not (np.all(scale.numpy() == 1) and np.all(bias.numpy() == 0)):
            continue
        groups, channels = scale.numpy().size, x.shape[1]
        eps = norm.attributes["epsilon"].value if "epsilon" in norm.attributes else 1e-5
        if ones is None:
            ones = ir.Value(name="klein_group_norm_one", const_value=ir.tensor(np.ones(1, np.float32)))
            model.graph.register_initializer(ones)
        into_groups = _int64s(model, f"klein_group_norm_shape_{norm.name}", [0, groups, -1, 0])
        back_shape = _int64s(model, f"klein_channels_shape_{norm.name}", [0, channels, -1, 0])
        rows = ir.Node("", "Reshape", [x, into_groups])  # [N, C, H, W] -> [N, G, C/G * H, W]
        row_shape = ir.Node("", "Shape", [rows.outputs[0]], [ir.AttrInt64("start", 2)])  # [C/G * H, W]
        scale_ones = ir.Node("", "Expand", [ones, row_shape.outputs[0]])  # [C/G * H, W] of 1
        normed = ir.Node(
            "", "LayerNormalization", [rows.outputs[0], scale_ones.outputs[0]],
            [ir.AttrInt64("axis", 2), ir.AttrFloat32("epsilon", eps)],
        )  # fmt: skip
        out = ir.Node("", "Reshape", [normed.outputs[0], back_shape])  # -> [N, C, H, W]
        new_nodes = [rows, row_shape, scale_ones, normed, out]
        ir.convenience.replace_nodes_and_values(
            model.graph, back, [grouped, norm, back], new_nodes, back.outputs, out.outputs
        )
        count += 1
    RemoveUnusedNodesPass()(model)  # the Shape(x) nodes and constants of the replaced chains
    return {"group_norms_as_layer_norms": count} if count else {}


def _int64s(model, name, values):
    """An int64 initializer of `model` named `name`."""
    value = ir.Value(name=name, const_value=ir.tensor(values, dtype=ir.DataType.INT64))
    model.graph.register_initializer(value)
    return value
