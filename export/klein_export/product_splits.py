"""Products cut into column ranges, one product per range (`--method dynamic` and `nbits`).

A transformer's fused projections are computed whole and then cut: the single blocks' `to_qkv_mlp_proj`
(`[tokens, 27648]` in the 4B: q, k, v and the two SwiGLU halves) by a `Split` and two `Slice`s,
the double blocks' feed-forward input (`[tokens, 18432]`) by two `Slice`s. Each cut copies its part
into a new tensor; at 1024x1024 (4608 tokens) one single block's cuts took about 1 s of ONNX
Runtime's profile against 0.9 s for its attention. Computing each range with its own product of
the weight's columns writes each part where its users read it and copies nothing.

With int8 weights per output channel (or MatMulNBits' blocks along K within a column) the pieces'
codes and scales are the columns of the whole weight's, and the activations are quantized per tensor
as before, so every output is the same, bit for bit. The input is quantized once per piece (a pass
over `[tokens, 3072]`).

A product whose input is only a `Concat` of the last axis (the single blocks' `to_out`, which reads
`[tokens, 3072 + 9216]`: the attention output beside the SwiGLU output) is computed, the same way, as
one product per part on that part's rows of the weight, summed by `Add`: the concatenation's copy is
gone. With per-channel int8 weights the parts' codes and scales are the rows of the whole weight's;
the activations are quantized per part (DynamicQuantizeLinear finds each part's own range, a little
finer than the whole's; `quantize.emulate_quantization` follows it). MatMulNBits' blocks along K stay
the same blocks where every part starts on a block boundary (`row_multiple`); only the float sum's
order changes.
"""

from dataclasses import dataclass
from pathlib import Path

import onnx

from .external_data import read_tensor

MAX_BOUNDS = 64  # the most values of an int64 constant read as a cut's bounds or sizes


@dataclass(frozen=True)
class Piece:
    """One product of a cut weight: it writes `output`, columns `start..stop` of the whole product."""

    output: str
    start: int
    stop: int


@dataclass(frozen=True)
class Part:
    """Rows `start..stop` of a product's weight, multiplied by `input` (that part of its input)."""

    input: str
    start: int
    stop: int


@dataclass(frozen=True)
class Plan:
    """A product computed as pieces (column ranges), each the sum of one product per input part."""

    pieces: list
    parts: list


class GraphUses:
    """What planning the cuts needs to know of a graph: each value's users and producer, the small int64
    constants (Slice's starts and ends, Split's sizes), each value's rank and known last dimension, the
    graph's outputs."""

    def __init__(self, graph: onnx.GraphProto, base_dir: Path):
        self.nodes = list(graph.node)  # held, so that a node's id() stays its own
        self.index = {id(node): i for i, node in enumerate(self.nodes)}
        self.users = {}
        for node in self.nodes:
            for name in node.input:
                self.users.setdefault(name, []).append(node)
        self.producers = {name: node for node in self.nodes for name in node.output}
        self.constants = {
            t.name: read_tensor(t, base_dir).reshape(-1).tolist()
            for t in graph.initializer
            if t.data_type == onnx.TensorProto.INT64 and len(t.dims) <= 1 and sum(t.dims) <= MAX_BOUNDS
        }
        values = [*graph.value_info, *graph.input, *graph.output]
        shapes = {v.name: v.type.tensor_type.shape.dim for v in values if v.type.tensor_type.HasField("shape")}
        self.ranks = {name: len(dims) for name, dims in shapes.items()}
        self.widths = {name: dims[-1].dim_value for name, dims in shapes.items() if dims and dims[-1].dim_value > 0}
        self.outputs = {o.name for o in graph.output}


def plan_products(graph: onnx.GraphProto, base_dir: Path, weight_of, row_multiple=1) -> tuple[dict, set]:
    """For every product of `graph` (a node for which `weight_of` gives its constant `[K, N]` weight):
    {its index in `graph.node`: its Plan}, one whole piece and one whole part where it is neither cut
    nor fed by a concatenation; and the indices of the cut and concatenation nodes the plans replace.
    `row_multiple`: what every part's first row must be a multiple of (MatMulNBits' block size)."""
    uses = GraphUses(graph, base_dir)
    plans, cut = {}, set()
    for i, node in enumerate(uses.nodes):
        w = weight_of(node)
        if w is None:
            continue
        rows, columns = w.dims
        pieces, cuts = column_pieces(uses, node.output[0], columns) or ([Piece(node.output[0], 0, columns)], [])
        parts, concat = input_parts(uses, node.input[0], rows, row_multiple) or ([Part(node.input[0], 0, rows)], None)
        plans[i] = Plan(pieces, parts)
        cut.update(uses.index[id(c)] for c in cuts)
        if concat is not None:
            cut.add(uses.index[id(concat)])
    return plans, cut


def input_parts(uses: GraphUses, value: str, rows: int, multiple: int) -> tuple[list, onnx.NodeProto] | None:
    """How a product's input `value` (`rows` wide) splits into parts: (parts, the Concat they
    replace), or None when it is not the output of a Concat of the last axis read by nothing else, with
    parts of known widths starting at multiples of `multiple`."""
    node, rank = uses.producers.get(value), uses.ranks.get(value)
    if node is None or node.op_type != "Concat" or node.domain not in ("", "ai.onnx") or rank is None:
        return None
    axis = {a.name: a.i for a in node.attribute}.get("axis")
    if axis not in (rank - 1, -1) or value in uses.outputs or len(uses.users.get(value, [])) != 1:
        return None
    widths = [uses.widths.get(name) for name in node.input]
    if len(widths) < 2 or None in widths or sum(widths) != rows:
        return None
    starts = [sum(widths[:i]) for i in range(len(widths) + 1)]
    if any(start % multiple for start in starts[:-1]):
        return None
    return [Part(name, starts[i], starts[i + 1]) for i, name in enumerate(node.input)], node


def product_nodes(plan: Plan, name: str, product) -> list:
    """The nodes that compute a planned product: `product(part, piece, output)` (a node that writes
    `output`, the product of `part`'s input and rows and `piece`'s columns of the weight) for each
    piece and part, and the `Add`s that sum the parts of each piece."""
    nodes = []
    for piece in plan.pieces:
        outputs = [piece.output] if len(plan.parts) == 1 else [f"{piece.output}_rows_{p.start}" for p in plan.parts]
        nodes += [product(part, piece, out) for part, out in zip(plan.parts, outputs, strict=True)]
        total = outputs[0]
        for j, out in enumerate(outputs[1:], 1):
            summed = piece.output if j == len(outputs) - 1 else f"{piece.output}_sum_{j}"
            nodes.append(onnx.helper.make_node("Add", [total, out], [summed], name=f"{name}_{piece.start}_sum_{j}"))
            total = summed
    return nodes


def column_pieces(uses: GraphUses, value: str, columns: int) -> tuple[list, list] | None:
    """How to compute `value`, a product with `columns` output columns, as pieces: (pieces, the cut
    nodes they replace), or None when it is not cut (a user that is no `Split`/`Slice` of the last
    axis with constant bounds, pieces wider together than the product, an unknown rank). Cuts of cuts
    are followed."""
    rank = uses.ranks.get(value)
    if rank is None:
        return None
    pieces, cuts = _pieces(uses, value, 0, columns, rank, top=True)
    if not cuts or sum(p.stop - p.start for p in pieces) > columns:
        return None
    return pieces, cuts


def _pieces(uses, value, start, stop, rank, top=False):
    users = uses.users.get(value, [])
    if not users and value not in uses.outputs and not top:
        return [], []  # a part nobody reads
    ranges = [_cut_ranges(uses, node, stop - start, rank) if node.input[0] == value else None for node in users]
    if value in uses.outputs or not users or any(r is None for r in ranges):
        return [Piece(value, start, stop)], []
    pieces, cuts = [], list(users)
    for node_ranges in ranges:
        for output, lo, hi in node_ranges:
            if output:
                more, more_cuts = _pieces(uses, output, start + lo, start + hi, rank)
                pieces += more
                cuts += more_cuts
    return pieces, cuts


def _cut_ranges(uses, node, width, rank):
    """[(output, start, stop)] of the columns `node` cuts from a `width`-column input, or None when it
    is not such a cut."""
    last = (rank - 1, -1)
    if node.op_type == "Slice" and node.domain in ("", "ai.onnx") and len(node.input) >= 4:
        starts, ends, axes = (uses.constants.get(name) for name in node.input[1:4])
        steps = uses.constants.get(node.input[4]) if len(node.input) > 4 and node.input[4] else [1]
        if None in (starts, ends, axes, steps) or len(axes) != 1 or axes[0] not in last or steps != [1]:
            return None
        lo, hi = (min(max(b + width if b < 0 else b, 0), width) for b in (starts[0], ends[0]))
        return [(node.output[0], lo, max(lo, hi))]
    if node.op_type == "Split" and node.domain in ("", "ai.onnx"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        sizes = uses.constants.get(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        if sizes is None and attrs.get("num_outputs"):  # equal parts of ceil(width / n), the last one smaller
            chunk = -(-width // attrs["num_outputs"])
            sizes = [min(chunk, width - i * chunk) for i in range(attrs["num_outputs"])]
        if attrs.get("axis", 0) not in last or sizes is None or sum(sizes) != width or min(sizes) < 0:
            return None
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        return [(out, bounds[i], bounds[i + 1]) for i, out in enumerate(node.output)]
    return None


def cut_float_products(model: onnx.ModelProto, base_dir: Path, row_multiple: int) -> tuple[int, int]:
    """Rewrites `model` (its weights in memory) in place: each MatMul with a constant 2-D weight whose
    output is only cut into column ranges, or whose input is only a concatenation (parts starting at
    multiples of `row_multiple`), becomes one MatMul per range and part, on a copy of that block of
    the weight (for MatMulNBits, whose blocks run along K within one column, so each piece quantizes
    as its block of the whole). Returns how many products were added, and how many products were
    split along their input."""
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model.graph
    weights = {i.name: i for i in graph.initializer}

    def weight_of(node):
        w = weights.get(node.input[1]) if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") else None
        return w if w is not None and len(w.dims) == 2 else None

    plans, cut = plan_products(graph, base_dir, weight_of, row_multiple)
    replacements, blocks, added, split_inputs = {}, {}, 0, 0
    for i, node in enumerate(graph.node):
        plan = plans.get(i)
        if plan is None or len(plan.pieces) * len(plan.parts) < 2:
            continue
        w = weight_of(node)
        values = numpy_helper.to_array(w)  # [K, N]

        def product(part, piece, output, w=w, values=values, node=node):
            block = f"{w.name}_rows_{part.start}_{part.stop}_columns_{piece.start}_{piece.stop}"
            blocks.setdefault(block, np.ascontiguousarray(values[part.start : part.stop, piece.start : piece.stop]))
            return helper.make_node(
                "MatMul", [part.input, block], [output], name=f"{node.name}_{part.start}_{piece.start}"
            )

        replacements[i] = product_nodes(plan, node.name, product)
        added += len(plan.pieces) * len(plan.parts) - 1
        split_inputs += len(plan.parts) > 1
    nodes = [new for i, node in enumerate(graph.node) if i not in cut for new in replacements.get(i, [node])]
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(numpy_helper.from_array(values, name) for name, values in blocks.items())
    used = {name for node in graph.node for name in node.input}
    kept = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return added, split_inputs
