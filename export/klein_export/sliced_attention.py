"""The VAE's mid-block attention in query slices, so that its [cells, cells] score matrix is never
whole in memory.

The VAE attends over every latent cell (one head of 512 channels): at 1024x1024 that is 16,384
cells, and the exported MatMul -> Softmax -> MatMul holds a 1 GiB score matrix and a 1 GiB softmax
of it (5.4 GiB each at 1536x1536). Softmax is taken along each query's row, so splitting the
queries into slices and attending slice by slice computes every output row exactly as the whole
product does (each row is the same dot products, in the same order), while only one slice's
scores are alive: 1/`SLICES` of the matrix. ONNX Runtime's fused MultiHeadAttention did not help
here (fused_attention.py: a higher peak at one head of 512).

The graph pass rewrites each `MatMul(q, kT) -> Softmax(axis=-1) -> MatMul(., v)` chain over rank-4
tensors into `Split(q)` along the query axis (slice sizes computed from the shape at run time: the
graphs take any size), the chain per slice, and `Concat`. Slices are written one after the other,
and ONNX Runtime runs them in that order, freeing each slice's scores before the next.
"""

import onnx
from onnx import helper

# Query slices: at 1024x1024, 128 MiB of scores (and as much of softmax) per slice instead of 1 GiB.
SLICES = 8


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    found: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            found.setdefault(name, []).append(node)
    return found


def _softmax_axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), -1)


def _chains(graph: onnx.GraphProto):
    """Each (scores MatMul, Softmax, output MatMul) of an attention, the softmax on the last axis
    and each intermediate used by the next node only."""
    consumers = _consumers(graph)
    producers = {out: node for node in graph.node for out in node.output}
    outputs = {o.name for o in graph.output}
    for softmax in graph.node:
        if softmax.op_type != "Softmax" or _softmax_axis(softmax) not in (-1, 3):
            continue
        scores = producers.get(softmax.input[0])
        after = consumers.get(softmax.output[0], [])
        if scores is None or scores.op_type != "MatMul" or len(after) != 1 or after[0].op_type != "MatMul":
            continue
        if len(consumers.get(scores.output[0], [])) != 1 or {scores.output[0], softmax.output[0]} & outputs:
            continue
        if after[0].input[0] != softmax.output[0]:
            continue
        yield scores, softmax, after[0]


def slice_attention(model: onnx.ModelProto, slices: int = SLICES) -> int:
    """Rewrites every attention chain of `model` (in place) into `slices` query slices; returns how
    many chains it rewrote."""
    graph = model.graph
    chains = list(_chains(graph))
    for n, (scores, softmax, output) in enumerate(chains):
        query, keys_t = scores.input
        values = output.input[1]
        tag = f"klein_sliced_attention_{n}"

        def name(what: str, tag=tag) -> str:
            return f"{tag}/{what}"

        consts = [
            helper.make_node("Constant", [], [name("axis_lo")], value_ints=[-2]),
            helper.make_node("Constant", [], [name("axis_hi")], value_ints=[-1]),
            helper.make_node("Constant", [], [name("slices")], value_ints=[slices]),
            helper.make_node("Constant", [], [name("rest")], value_ints=[slices - 1]),
        ]
        # [B, H, S, D] -> S as [1]; slice c = S // slices, the last S - (slices - 1) * c.
        sizes = [
            helper.make_node("Shape", [query], [name("shape")]),
            helper.make_node("Slice", [name("shape"), name("axis_lo"), name("axis_hi")], [name("cells")]),
            helper.make_node("Div", [name("cells"), name("slices")], [name("size")]),
            helper.make_node("Mul", [name("size"), name("rest")], [name("before_last")]),
            helper.make_node("Sub", [name("cells"), name("before_last")], [name("last")]),
            helper.make_node("Concat", [name("size")] * (slices - 1) + [name("last")], [name("sizes")], axis=0),
        ]
        parts = [name(f"query_{i}") for i in range(slices)]
        body = [helper.make_node("Split", [query, name("sizes")], parts, axis=-2)]
        outs = []
        for i, part in enumerate(parts):
            # [B, H, S/slices, D] x [B, H, D, S] -> scores [B, H, S/slices, S] -> [B, H, S/slices, D]
            body += [
                helper.make_node("MatMul", [part, keys_t], [name(f"scores_{i}")]),
                helper.make_node("Softmax", [name(f"scores_{i}")], [name(f"probs_{i}")], axis=-1),
                helper.make_node("MatMul", [name(f"probs_{i}"), values], [name(f"out_{i}")]),
            ]
            outs.append(name(f"out_{i}"))
        body.append(helper.make_node("Concat", outs, [output.output[0]], axis=-2))

        for node in consts + sizes + body:  # named after what they make (ONNX Runtime's profile)
            node.name = node.output[0]
        # In place of the output MatMul: every input is made before it, every use comes after.
        nodes = list(graph.node)
        at = nodes.index(output)
        before = [x for x in nodes[:at] if x is not scores and x is not softmax]
        del graph.node[:]
        graph.node.extend(before + consts + sizes + body + nodes[at + 1 :])
    return len(chains)
