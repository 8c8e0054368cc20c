"""The statically quantized VAE decoder's group norms computed in channel parts (`--method static`).

In the decoder each group norm of a resnet (and the last one, before the RGB output convolution) is
followed by SiLU and a convolution; in a statically quantized decoder the SiLU's float output
exists only to be quantized to uint8 for the next integer convolution. At 1024x1024 the largest of
them (the last up block's 256 channels at full size) are 1 GiB each in float32, and ONNX Runtime
holds the dequantized input and the normalised output at once. A group norm is independent per
group, so each chain (Reshape into groups, LayerNormalization, the affine Mul and Add, Sigmoid and
Mul) is rewritten as PARTS chains over channel ranges of whole groups: a chain that reads a
per-tensor DequantizeLinear slices the uint8 codes and dequantizes each part, and the parts'
QuantizeLinear outputs (the whole's per-tensor scale and zero point) are concatenated in uint8, so
no float tensor larger than a part exists. The RGB output convolution's input stays float (it has
no QuantizeLinear): its parts are concatenated in float. Each group's rows are normalised by the
same kernel over the same values: the outputs are unchanged, bit for bit (benches/RESULTS.md, "Group norms in
channel parts"). Float decoders keep whole norms: there the parts' float concatenations cost more
than the parts save (measured, same section). Only the exact form that
`ort_fusions.group_norms_as_layer_norms` and `quantize_static` write is matched; any other chain
is left whole.
"""

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

SMALL = 1 << 16  # elements: more than any norm's channels
# Wide dds decoder at 1024x1024, whole-norm peak 3.65 GiB: 2 parts 3.47, 4 and 8 parts 3.23 GiB
# (Q-ended chains only; 3.07 with the RGB conv's input in 4 float parts too, as written).
PARTS = 4
GRAPH_OUTPUT = object()  # stands for a graph output among a value's readers


@dataclass
class _Chain:
    """One group norm's chain as matched: its nodes, its input's producer and its factors."""

    nodes: list  # the chain's nodes, removed: norm, back Reshape, Mul, Add, Sigmoid, Mul (SiLU)[, QuantizeLinear]
    rows: onnx.NodeProto  # the Reshape into groups (kept: a Shape may read it)
    quantize: onnx.NodeProto | None  # the per-tensor QuantizeLinear at the end, or None (float end)
    output: str  # the chain's output (the QuantizeLinear's, else the SiLU's): the parts' Concat writes it
    groups: int
    channels: int
    gamma: np.ndarray  # [C, 1, 1]
    beta: np.ndarray  # [C, 1, 1]


def _match(norm, made_by, read_by, constants) -> _Chain | None:
    """`norm`'s chain in group_norms_as_layer_norms's form, each value read by the next node only
    (not by another node nor as a graph output), or None."""

    def only(value, op_type):
        readers = read_by.get(value, [])
        single = len(readers) == 1 and readers[0] is not GRAPH_OUTPUT and readers[0].op_type == op_type
        return readers[0] if single else None

    rows = made_by.get(norm.input[0])
    if len(norm.input) != 2 or len(norm.output) != 1 or _attribute(norm, "axis", -1) != 2:
        return None  # a bias, a Mean or InvStdDev output, or another axis: not the rewrite's form
    if rows is None or rows.op_type != "Reshape" or _attribute(rows, "allowzero", 0):
        return None
    back = only(norm.output[0], "Reshape")
    mul = back and only(back.output[0], "Mul")
    add = mul and only(mul.output[0], "Add")
    if add is None or _attribute(back, "allowzero", 0):
        return None
    readers = read_by.get(add.output[0], [])
    sigmoid = next((r for r in readers if r is not GRAPH_OUTPUT and r.op_type == "Sigmoid"), None)
    silu = next((r for r in readers if r is not GRAPH_OUTPUT and r.op_type == "Mul"), None)
    if len(readers) != 2 or sigmoid is None or silu is None or only(sigmoid.output[0], "Mul") != silu:
        return None
    if sorted(silu.input) != sorted([add.output[0], sigmoid.output[0]]):
        return None
    quantize = only(silu.output[0], "QuantizeLinear")
    if quantize is None and only(silu.output[0], "Conv") is None:
        return None
    if quantize is not None and not _per_tensor(quantize, constants):
        return None
    regroup, regroup_back = (constants.get(n.input[1]) for n in (rows, back))
    gamma, beta = (constants.get(n.input[1]) for n in (mul, add))
    if regroup is None or regroup_back is None or gamma is None or beta is None:
        return None
    if regroup.shape != (4,) or regroup_back.shape != (4,):
        return None
    groups, channels = int(regroup[1]), int(regroup_back[1])
    if list(regroup) != [0, groups, -1, 0] or list(regroup_back) != [0, channels, -1, 0]:
        return None
    if groups <= 0 or groups % PARTS or channels % groups:
        return None
    if gamma.shape != (channels, 1, 1) or beta.shape != gamma.shape:
        return None
    nodes = [norm, back, mul, add, sigmoid, silu] + ([quantize] if quantize is not None else [])
    output = (quantize if quantize is not None else silu).output[0]
    return _Chain(nodes, rows, quantize, output, groups, channels, gamma, beta)


def group_norms_in_parts(model: onnx.ModelProto) -> int:
    """Rewrites (in place) each group norm + SiLU chain of a statically quantized decoder as PARTS
    chains over whole groups (module docstring); returns how many chains were rewritten."""
    graph = model.graph
    # The small initializers (shapes, affine factors, quantization scales), not the weights.
    constants = {i.name: numpy_helper.to_array(i) for i in graph.initializer if np.prod(i.dims) <= SMALL}
    replaced = []  # the rewritten chains' nodes, their Reshapes into groups and their inputs' producers
    count = 0
    for norm in [n for n in graph.node if n.op_type == "LayerNormalization"]:
        made_by = {o: n for n in graph.node for o in n.output}
        read_by = {o.name: [GRAPH_OUTPUT] for o in graph.output}
        for node in graph.node:
            for name in node.input:
                read_by.setdefault(name, []).append(node)
        chain = _match(norm, made_by, read_by, constants)
        if chain is None:
            continue
        dequantize = made_by.get(chain.rows.input[0])
        new_nodes, new_constants = _parts(chain, dequantize, constants)
        # Before the chain's last node: every input of the parts is made before it, every reader after.
        at = list(graph.node).index(chain.nodes[-1])
        for offset, node in enumerate(new_nodes):
            graph.node.insert(at + offset, node)
        for node in chain.nodes:
            graph.node.remove(node)
        graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in new_constants.items())
        replaced += [chain.rows, *chain.nodes] + ([dequantize] if dequantize is not None else [])
        count += 1
    _drop_unread(graph, replaced)
    return count


def _per_tensor(node, constants) -> bool:
    """A QuantizeLinear/DequantizeLinear with a constant scalar scale and zero point (if any)."""
    return all(constants.get(n) is not None and constants[n].size == 1 for n in node.input[1:])


def _parts(chain: _Chain, dequantize, constants):
    """The nodes and constants of `chain` computed in PARTS channel ranges, concatenated."""
    norm, quantize = chain.nodes[0], chain.quantize
    per_tensor = (
        dequantize is not None and dequantize.op_type == "DequantizeLinear" and _per_tensor(dequantize, constants)
    )
    source = dequantize.input[0] if per_tensor else chain.rows.input[0]  # uint8 codes, or the float input
    prefix = norm.output[0]  # unique, where node names need not be
    nodes, values, outputs = [], {}, []
    width = chain.channels // PARTS
    axes, rows_shape, channels_shape = (f"{prefix}_parts_{n}" for n in ("axes", "rows_shape", "channels_shape"))
    values[axes] = np.array([1], np.int64)
    values[rows_shape] = np.array([0, chain.groups // PARTS, -1, 0], np.int64)
    values[channels_shape] = np.array([0, width, -1, 0], np.int64)
    for part in range(PARTS):
        p = f"{prefix}_part{part}"
        values[f"{p}_starts"] = np.array([part * width], np.int64)
        values[f"{p}_ends"] = np.array([(part + 1) * width], np.int64)
        values[f"{p}_gamma"] = np.ascontiguousarray(chain.gamma[part * width : (part + 1) * width])
        values[f"{p}_beta"] = np.ascontiguousarray(chain.beta[part * width : (part + 1) * width])
        x = f"{p}_in"  # [N, C/PARTS, H, W]: codes or float
        nodes.append(helper.make_node("Slice", [source, f"{p}_starts", f"{p}_ends", axes], [x], name=x))
        if per_tensor:
            nodes.append(_like(dequantize, [x, *dequantize.input[1:]], f"{p}_dq"))
            x = f"{p}_dq"
        nodes += [
            # [N, C/PARTS, H, W] -> [N, G/PARTS, C/G * H, W]: the LN scale (ones) has the whole's last two dims
            helper.make_node("Reshape", [x, rows_shape], [f"{p}_rows"], name=f"{p}_rows"),
            _like(norm, [f"{p}_rows", norm.input[1]], f"{p}_normed"),
            helper.make_node("Reshape", [f"{p}_normed", channels_shape], [f"{p}_back"], name=f"{p}_back"),
            helper.make_node("Mul", [f"{p}_back", f"{p}_gamma"], [f"{p}_scaled"], name=f"{p}_scaled"),
            helper.make_node("Add", [f"{p}_scaled", f"{p}_beta"], [f"{p}_shifted"], name=f"{p}_shifted"),
            helper.make_node("Sigmoid", [f"{p}_shifted"], [f"{p}_sigmoid"], name=f"{p}_sigmoid"),
            helper.make_node("Mul", [f"{p}_shifted", f"{p}_sigmoid"], [f"{p}_silu"], name=f"{p}_silu"),
        ]
        outputs.append(f"{p}_silu")
        if quantize is not None:  # uint8 parts, the whole's scale and zero point
            nodes.append(_like(quantize, [f"{p}_silu", *quantize.input[1:]], f"{p}_q"))
            outputs[-1] = f"{p}_q"
    nodes.append(helper.make_node("Concat", outputs, [chain.output], name=f"{prefix}_parts", axis=1))
    return nodes, values


def _like(node, inputs, output):
    """A node of `node`'s type, domain and attributes on `inputs`, writing (and named) `output`."""
    copy = helper.make_node(node.op_type, inputs, [output], name=output, domain=node.domain or None)
    copy.attribute.extend(node.attribute)
    return copy


def _attribute(node, name, default):
    """The value of `node`'s attribute `name`, else ONNX's `default`."""
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _drop_unread(graph, replaced):
    """Removes what the rewrites left unread: the replaced chains' Reshapes into groups and
    DequantizeLinears where nothing else reads them, then the initializers only removed nodes read
    (affine factors, shapes)."""
    outputs = {o.name for o in graph.output}
    candidates = [n for n in graph.node if n in replaced]
    while True:
        read = {name for n in graph.node for name in n.input} | outputs
        unread = [n for n in candidates if n in graph.node and not any(o in read for o in n.output)]
        if not unread:
            break
        for node in unread:
            graph.node.remove(node)
    read = {name for n in graph.node for name in n.input} | outputs | {i.name for i in graph.input}
    was_read = {name for n in replaced for name in n.input}
    for tensor in [i for i in graph.initializer if i.name in was_read and i.name not in read]:
        graph.initializer.remove(tensor)
