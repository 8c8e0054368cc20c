"""The statically quantized VAE decoder's group norms computed in channel parts (`--method static`).

In the decoder every group norm is followed by SiLU and then by a convolution; in a statically
quantized decoder the SiLU's float output exists only to be quantized to uint8 for the next
integer convolution. At 1024x1024 the largest of them (the last up block's 256 channels at full
size) are 1 GiB each in float32, and ONNX Runtime holds the dequantized input and the normalised
output at once. A group norm is independent per group, so each chain (Reshape into groups,
LayerNormalization, the affine Mul and Add, Sigmoid and Mul) is rewritten as PARTS chains over
channel ranges of whole groups: a chain that reads a per-tensor DequantizeLinear slices the uint8
codes and dequantizes each part, and the parts' QuantizeLinear outputs (same scale and zero point
as the whole's) are concatenated in uint8, so no float tensor larger than a part exists. The RGB
output convolution's input stays float (it has no QuantizeLinear): its parts are concatenated in
float. Each group's rows are normalised by the same kernel over the same values: the outputs are
unchanged, bit for bit (README, "Group norms in channel parts"). Float decoders keep whole norms:
there the parts' float concatenation costs what the parts save (measured, same section).
"""

import numpy as np
import onnx
from onnx import helper, numpy_helper

SMALL = 1 << 16  # elements: more than any norm's channels
PARTS = 4  # 4 and 8 parts: the same peak at 1024x1024 (wide decoder, 3.07 / 3.04 GiB); 2: 3.47 GiB


class _Chain:
    """One group norm's chain in the graph, or None fields where the pattern does not hold."""

    def __init__(self, norm, made_by, read_by, constants):
        self.norm = norm
        self.rows = made_by.get(norm.input[0])
        back = self._only_reader(norm.output[0], read_by, "Reshape")
        self.mul = back and self._only_reader(back.output[0], read_by, "Mul")
        self.add = self.mul and self._only_reader(self.mul.output[0], read_by, "Add")
        readers = read_by.get(self.add.output[0], []) if self.add else []
        sigmoid = [r for r in readers if r.op_type == "Sigmoid"]
        silu = [r for r in readers if r.op_type == "Mul"]
        self.nodes = None
        if len(readers) != 2 or len(sigmoid) != 1 or len(silu) != 1 or self.rows is None:
            return
        self.sigmoid, self.silu = sigmoid[0], silu[0]
        if sorted(self.silu.input) != sorted([self.add.output[0], self.sigmoid.output[0]]):
            return
        end = read_by.get(self.silu.output[0], [])
        if len(end) != 1 or end[0].op_type not in ("QuantizeLinear", "Conv"):
            return
        self.quantize = end[0] if end[0].op_type == "QuantizeLinear" else None
        shapes = [constants.get(n.input[1]) for n in (self.rows, back)]
        gamma, beta = (constants.get(n.input[1]) for n in (self.mul, self.add))
        if self.rows.op_type != "Reshape" or any(s is None or s.shape != (4,) for s in shapes):
            return
        if _attribute(norm, "axis", -1) != 2:  # ort_fusions.group_norms_as_layer_norms's form
            return
        if gamma is None or beta is None:
            return
        self.groups, self.channels = int(shapes[0][1]), int(shapes[1][1])
        if self.groups % PARTS or gamma.shape != (self.channels, 1, 1) or beta.shape != gamma.shape:
            return
        self.gamma, self.beta = gamma, beta
        self.nodes = [norm, back, self.mul, self.add, self.sigmoid, self.silu] + [self.quantize] * (
            self.quantize is not None
        )

    @staticmethod
    def _only_reader(name, read_by, op_type):
        readers = read_by.get(name, [])
        return readers[0] if len(readers) == 1 and readers[0].op_type == op_type else None


def group_norms_in_parts(model: onnx.ModelProto) -> int:
    """Rewrites (in place) each group norm + SiLU chain of a statically quantized decoder as PARTS
    chains over whole groups (module docstring); returns how many chains were rewritten."""
    graph = model.graph
    # The small initializers (shapes, affine factors, quantization scales), not the weights.
    constants = {i.name: numpy_helper.to_array(i) for i in graph.initializer if np.prod(i.dims) <= SMALL}
    count = 0
    for norm in [n for n in graph.node if n.op_type == "LayerNormalization"]:
        made_by = {o: n for n in graph.node for o in n.output}
        read_by = {}
        for node in graph.node:
            for name in node.input:
                read_by.setdefault(name, []).append(node)
        chain = _Chain(norm, made_by, read_by, constants)
        if chain.nodes is None:
            continue
        new_nodes, new_constants = _parts(chain, made_by.get(chain.rows.input[0]), constants)
        at = list(graph.node).index(norm)
        for node in chain.nodes:
            graph.node.remove(node)
        for offset, node in enumerate(new_nodes):
            graph.node.insert(at + offset, node)
        graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in new_constants.items())
        constants.update(new_constants)
        count += 1
    _drop_unread(graph)
    return count


def _parts(chain: _Chain, dequantize, constants):
    """The nodes and constants of `chain` computed in PARTS channel ranges, concatenated."""
    norm, quantize = chain.norm, chain.quantize
    per_tensor = (
        dequantize is not None
        and dequantize.op_type == "DequantizeLinear"
        and all(constants.get(n) is not None and constants[n].size == 1 for n in dequantize.input[1:])
    )
    source = dequantize.input[0] if per_tensor else chain.rows.input[0]  # uint8 codes, or the float input
    nodes, values, outputs = [], {}, []
    width = chain.channels // PARTS
    axes, rows_shape, channels_shape = (f"{norm.name}_parts_{n}" for n in ("axes", "rows_shape", "channels_shape"))
    values[axes] = np.array([1], np.int64)
    values[rows_shape] = np.array([0, chain.groups // PARTS, -1, 0], np.int64)
    values[channels_shape] = np.array([0, width, -1, 0], np.int64)
    for part in range(PARTS):
        p = f"{norm.name}_part{part}"
        values[f"{p}_starts"] = np.array([part * width], np.int64)
        values[f"{p}_ends"] = np.array([(part + 1) * width], np.int64)
        values[f"{p}_gamma"] = np.ascontiguousarray(chain.gamma[part * width : (part + 1) * width])
        values[f"{p}_beta"] = np.ascontiguousarray(chain.beta[part * width : (part + 1) * width])
        x = f"{p}_in"  # [N, C/PARTS, H, W]: codes or float
        nodes.append(helper.make_node("Slice", [source, f"{p}_starts", f"{p}_ends", axes], [x], name=x))
        if per_tensor:
            nodes.append(helper.make_node("DequantizeLinear", [x, *dequantize.input[1:]], [f"{p}_dq"], name=f"{p}_dq"))
            x = f"{p}_dq"
        nodes += [
            # [N, C/PARTS, H, W] -> [N, G/PARTS, C/G * H, W]: the LN scale (ones) has the whole's last two dims
            helper.make_node("Reshape", [x, rows_shape], [f"{p}_rows"], name=f"{p}_rows"),
            helper.make_node(
                "LayerNormalization",
                [f"{p}_rows", norm.input[1]],
                [f"{p}_normed"],
                name=f"{p}_normed",
                axis=2,
                epsilon=_attribute(norm, "epsilon", 1e-5),
            ),  # fmt: skip
            helper.make_node("Reshape", [f"{p}_normed", channels_shape], [f"{p}_back"], name=f"{p}_back"),
            helper.make_node("Mul", [f"{p}_back", f"{p}_gamma"], [f"{p}_scaled"], name=f"{p}_scaled"),
            helper.make_node("Add", [f"{p}_scaled", f"{p}_beta"], [f"{p}_shifted"], name=f"{p}_shifted"),
            helper.make_node("Sigmoid", [f"{p}_shifted"], [f"{p}_sigmoid"], name=f"{p}_sigmoid"),
            helper.make_node("Mul", [f"{p}_shifted", f"{p}_sigmoid"], [f"{p}_silu"], name=f"{p}_silu"),
        ]
        outputs.append(f"{p}_silu")
        if quantize is not None:  # uint8 parts, the whole's scale and zero point
            nodes.append(
                helper.make_node("QuantizeLinear", [f"{p}_silu", *quantize.input[1:]], [f"{p}_q"], name=f"{p}_q")
            )
            outputs[-1] = f"{p}_q"
    whole = quantize.output[0] if quantize is not None else chain.silu.output[0]
    nodes.append(helper.make_node("Concat", outputs, [whole], name=f"{norm.name}_parts", axis=1))
    return nodes, values


def _attribute(node, name, default):
    """The value of `node`'s attribute `name`, else ONNX's `default`."""
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _drop_unread(graph):
    """Removes the nodes and initializers that nothing reads any more (the replaced chains' Reshapes,
    DequantizeLinears, shapes and affine factors); graph outputs are read."""
    while True:
        read = {name for n in graph.node for name in n.input} | {o.name for o in graph.output}
        unread = [n for n in graph.node if not any(o in read for o in n.output)]
        if not unread:
            break
        for node in unread:
            graph.node.remove(node)
    read = {name for n in graph.node for name in n.input}
    for tensor in [i for i in graph.initializer if i.name not in read]:
        graph.initializer.remove(tensor)
