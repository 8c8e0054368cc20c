"""The VAE decoder's upsamplers as four small convolutions at the lower resolution (an exact rewrite).

A diffusers `Upsample2D` is a nearest-neighbour 2x `Resize` followed by a 3x3 convolution (padding
1) at the doubled size: 9 multiply-adds per output pixel and channel pair, over an input whose
pixels are each repeated four times. Each output pixel's parity `(a, b)` (row, column) fixes which
source pixels its 3x3 window sees: for an even row `2i`, upsampled rows `2i-1, 2i, 2i+1` are source
rows `i-1, i, i`; for an odd row `2i+1`, they are `i, i, i+1` (the same for columns). So each of the
four output phases is a 2x2 convolution of the source, whose taps are sums of the 3x3 taps, with
one pixel of zero padding on the side the window reaches past (the upsampled image's zero border
is the source's): 4 multiply-adds per output pixel instead of 9, on an input a quarter the size.
The phases are concatenated along channels and interleaved by `DepthToSpace` (DCR order: channel
`(2a + b) * C + c` goes to pixel `(2i + a, 2j + b)` of channel `c`).

The result differs from the original only by float rounding (the summed taps are rounded once from
float64, and the products are added in another order)."""

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

# Source rows (or columns) u = 0, 1 of a 2x2 phase kernel <- rows dy = 0, 1, 2 of the 3x3 kernel,
# for an even (a = 0) and an odd (a = 1) output row.
_TAP_SUMS = (
    np.array([[1, 0, 0], [0, 1, 1]], np.float64),
    np.array([[1, 1, 0], [0, 0, 1]], np.float64),
)


def phase_kernels(weight):
    """`[Cout, Cin, 3, 3]` -> the four phases' `[Cout, Cin, 2, 2]` kernels, in the order
    (a, b) = (0, 0), (0, 1), (1, 0), (1, 1); each rounded once to `weight`'s dtype."""
    w = weight.astype(np.float64)
    return [
        np.einsum("ud,ocde,ve->ocuv", _TAP_SUMS[a], w, _TAP_SUMS[b]).astype(weight.dtype)
        for a in (0, 1)
        for b in (0, 1)
    ]


def upsamplers_as_phase_convs(model) -> dict:
    """Rewrites (in place) each nearest 2x Resize whose only user is a 3x3, stride-1, padding-1,
    ungrouped Conv with constant weights (directly, or through a Cast: fp16 bundles resize in float32)
    as four 2x2 Convs + Concat + DepthToSpace (the Cast then on the source); returns the count.
    Anything else (another interpolation, scale, kernel or padding) is left as it is."""
    count = 0
    for conv in list(model.graph):
        chain = _upsampler(conv)  # [Resize, (Cast,) Conv]
        if chain is None:
            continue
        weight = ir.convenience.get_const_tensor(conv.inputs[1]).numpy()
        bias = conv.inputs[2] if len(conv.inputs) > 2 else None
        x = chain[0].inputs[0]  # [N, Cin, H, W]
        new_nodes = []
        if len(chain) == 3:  # the Cast, on the source: elementwise, so it commutes with the copy
            to = ir.AttrInt64("to", int(chain[1].attributes["to"].value))
            new_nodes.append(ir.Node("", "Cast", [x], [to], name=f"{conv.name}_cast"))
            x = new_nodes[0].outputs[0]
        phases = []
        for index, kernel in enumerate(phase_kernels(weight)):
            a, b = divmod(index, 2)
            taps = ir.Value(name=f"{conv.name}_phase{a}{b}_weight", const_value=ir.tensor(kernel))
            model.graph.register_initializer(taps)
            pads = [1 - a, 1 - b, a, b]  # top, left, bottom, right: the side this phase reaches past
            inputs = [x, taps] + ([bias] if bias is not None else [])
            attrs = [ir.AttrInt64s("kernel_shape", [2, 2]), ir.AttrInt64s("pads", pads)]
            phases.append(ir.Node("", "Conv", inputs, attrs, name=f"{conv.name}_phase{a}{b}"))  # -> [N, Cout, H, W]
        parts = [p.outputs[0] for p in phases]
        axis = [ir.AttrInt64("axis", 1)]
        stacked = ir.Node("", "Concat", parts, axis, name=f"{conv.name}_phases")  # [N, 4Cout, H, W]
        dcr = [ir.AttrInt64("blocksize", 2), ir.AttrString("mode", "DCR")]
        out = ir.Node("", "DepthToSpace", stacked.outputs, dcr, name=f"{conv.name}_interleave")  # -> [N, Cout, 2H, 2W]
        new_nodes += [*phases, stacked, out]
        ir.convenience.replace_nodes_and_values(model.graph, conv, chain, new_nodes, conv.outputs, out.outputs)
        count += 1
    RemoveUnusedNodesPass()(model)  # the 3x3 weights and the Resize's scales
    return {"upsamplers_as_phase_convs": count} if count else {}


def _upsampler(conv):
    """`[Resize, Conv]` or `[Resize, Cast, Conv]` if `conv` and the nearest 2x Resize feeding it (each
    node's output read by the next only) are an upsampler this rewrite is exact for, else None."""
    if conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx"):
        return None
    chain = [conv]
    while len(chain) < 3 and chain[0].inputs[0] is not None:
        producer = chain[0].inputs[0].producer()
        if producer is None or len(list(producer.outputs[0].uses())) != 1:
            return None
        chain.insert(0, producer)
        if producer.op_type == "Resize":
            break
        if producer.op_type != "Cast":
            return None
    resize = chain[0]
    if resize.op_type != "Resize":
        return None
    weight = ir.convenience.get_const_tensor(conv.inputs[1])
    if weight is None or len(weight.shape) != 4 or tuple(weight.shape)[2:] != (3, 3):
        return None
    if len(conv.inputs) > 2 and conv.inputs[2] is not None and ir.convenience.get_const_tensor(conv.inputs[2]) is None:
        return None
    attrs = {name: attr.value for name, attr in conv.attributes.items()}
    if list(attrs.get("pads", [])) != [1, 1, 1, 1] or attrs.get("auto_pad", "NOTSET") != "NOTSET":
        return None
    if list(attrs.get("strides", [1, 1])) != [1, 1] or list(attrs.get("dilations", [1, 1])) != [1, 1]:
        return None
    if attrs.get("group", 1) != 1:
        return None
    return chain if _nearest_2x(resize) else None


def _nearest_2x(resize):
    """True if `resize` copies each pixel of `[N, C, H, W]` to a 2x2 block (nearest, asymmetric,
    floor: output row y reads row floor(y / 2)), by constant scales [1, 1, 2, 2]."""
    attrs = {name: attr.value for name, attr in resize.attributes.items()}
    if resize.domain not in ("", "ai.onnx") or "axes" in attrs:  # scales for other axes than N, C, H, W
        return False
    if attrs.get("mode") != "nearest" or attrs.get("coordinate_transformation_mode") != "asymmetric":
        return False
    if attrs.get("nearest_mode", "round_prefer_floor") not in ("floor", "round_prefer_floor"):
        return False
    if len(resize.inputs) < 3 or resize.inputs[2] is None or (len(resize.inputs) > 3 and resize.inputs[3] is not None):
        return False
    scales = ir.convenience.get_const_tensor(resize.inputs[2])
    return scales is not None and scales.numpy().tolist() == [1.0, 1.0, 2.0, 2.0]
