"""The text encoder's attention over the real tokens' keys only (`ort_fusions.fuse_for_ort`).

Under the causal and padding mask no query attends to a key after the last real token of the batch:
such a key's bias is the lowest float in every row, its weight exactly 0. So each attention takes its
keys, values and bias up to `L` = 1 + the last position where `attention_mask` is 1 in any row,
rounded up to a multiple of 16 (at most all keys): a prompt of 40 tokens padded to 512 attends over
48 keys. The keys and values of the padding are not computed either: each layer's key and value
projections (and the key's norm and rotary embedding, and the grouped heads' repetition) run on the
layer's input up to the last real token, 5% of the Qwen3 4B layer's weights applied to 40 rows
instead of 512, and the zero rows up to `L` are keys the bias masks. The queries of the padding
still get their outputs (they attend to the real tokens), as diffusers computes them.

The multiple of 16 keeps the bias rows aligned as ONNX Runtime's CUDA kernel (cutlass
memory-efficient attention) requires: with 41 keys it refused to run on an H200 ("attn_bias is not
correctly aligned"). Written for any mask in which every query may attend to some key (right
padding, as diffusers pads, or left): a query with none would average all values, as many as kept."""

import onnx_ir as ir

REAL_ROWS = "real_tokens"  # the symbolic length of the keys' rows computed, in the graph's shapes


def attend_to_real_keys_only(model) -> tuple:
    """Trims (in place) each MultiHeadAttention of the text encoder `model` (an onnx_ir model) to the
    real tokens' keys; returns the number of attentions trimmed and of key and value projections
    computed on the rows up to the last real token only (`_Rows.project_rows_only`; where it cannot
    rewrite the chain, the keys or values are sliced to `L` after it)."""
    mask = next((v for v in model.graph.inputs if v.name == "attention_mask"), None)
    attentions = [
        n
        for n in model.graph
        if n.op_type == "MultiHeadAttention"
        and len(n.inputs) == 6
        and all(n.inputs[i] is not None and n.inputs[i].shape is not None for i in (1, 2, 5))
        and [len(n.inputs[i].shape) for i in (1, 2, 5)] == [3, 3, 4]
    ]
    if mask is None or not attentions or mask.shape is None or len(mask.shape) != 2:
        return 0, 0
    trim = _Rows(model, mask)
    projections = 0
    for attention in attentions:
        slices = []
        for index in (1, 2):
            if trim.project_rows_only(attention, index):
                projections += 1
            else:  # key or value [B, S, H*D] -> [B, L, H*D]
                slices.append(trim.slice_node(attention.inputs[index], 1))
                attention.replace_input_with(index, slices[-1].outputs[0])
        # bias [B, 1, S, S] -> [B, 1, S, L]
        slices.append(trim.slice_node(attention.inputs[5], 3))
        attention.replace_input_with(5, slices[-1].outputs[0])
        model.graph.insert_before(attention, slices)
    return len(attentions), projections


class _Rows:
    """`L`, computed once from the mask at the start of the graph, and the slices to it."""

    def __init__(self, model, mask):
        self.model, self.mask, self.seq = model, mask, mask.shape[1]
        self.zero = self._const("klein_zero", [0])
        one = self._const("klein_one", 1)
        # attention_mask [B, S] -> L [1]: max over b, s of mask[b, s] * (s + 1), rounded up to a
        # multiple of 16 (Slice clamps it to S)
        length = ir.Node("", "Shape", [mask], [ir.AttrInt64("start", 1), ir.AttrInt64("end", 2)])
        scalar = ir.Node("", "Squeeze", [length.outputs[0]])
        limit = ir.Node("", "Add", [scalar.outputs[0], one])
        positions = ir.Node("", "Range", [one, limit.outputs[0], one])  # [S]: 1..S
        masked = ir.Node("", "Mul", [mask, positions.outputs[0]])  # [B, S]
        last = ir.Node("", "ReduceMax", [masked.outputs[0]], [ir.AttrInt64("keepdims", 1)])  # [1, 1]
        padded = ir.Node("", "Add", [last.outputs[0], self._const("klein_fifteen", 15)])
        blocks = ir.Node("", "Div", [padded.outputs[0], self._const("klein_sixteen", 16)])  # int64: floor
        rounded = ir.Node("", "Mul", [blocks.outputs[0], self._const("klein_sixteen_", 16)])
        shape_1 = self._const("klein_shape_1", [1])
        end = ir.Node("", "Reshape", [rounded.outputs[0], shape_1])  # [1]: L
        real = ir.Node("", "Reshape", [last.outputs[0], shape_1])  # [1]: 1 + the last real position
        gap = ir.Node("", "Sub", [end.outputs[0], real.outputs[0]])  # [1]: L - real, at most 15
        # Pad's [begin of each axis, end of each axis] of a [B, rows, E] value: rows up to L
        zeros = self._const("klein_zeros_4", [0] * 4)
        pads = ir.Node("", "Concat", [zeros, gap.outputs[0], self.zero], [ir.AttrInt64("axis", 0)])
        nodes = [length, scalar, limit, positions, masked, last, padded, blocks, rounded, end, real, gap, pads]
        model.graph.insert_before(next(iter(model.graph)), nodes)
        self.end, self.real, self.pads = end.outputs[0], real.outputs[0], pads.outputs[0]
        self.axes = {}
        self.sliced = {}  # (value, axis) -> its entries up to the last real token along axis
        self.lengths = {}  # a shape's Concat -> the same with the real tokens' count for S

    def _const(self, name, values):
        value = ir.Value(name=name, const_value=ir.tensor(values, dtype=ir.DataType.INT64))
        self.model.graph.register_initializer(value)
        return value

    def slice_node(self, value, axis):
        """A new node: `value`'s first L entries along `axis`."""
        return ir.Node("", "Slice", [value, self.zero, self.end, self._axis(axis)])

    def _axis(self, axis):
        if axis not in self.axes:
            self.axes[axis] = self._const(f"klein_axis_{axis}", [axis])
        return self.axes[axis]

    def _real_rows(self, value, axis):
        """`value`'s entries along `axis` up to the last real token, one Slice per value and axis,
        placed right after the value is made."""
        key = (value, axis)
        if key not in self.sliced:
            node = ir.Node("", "Slice", [value, self.zero, self.real, self._axis(axis)])
            _insert_after_producer(self.model, value, [node])
            self.sliced[key] = node.outputs[0]
        return self.sliced[key]

    def _mask_dims(self, value):
        """`(start, end)` if `value` is `Shape(mask, start, end)`, else None."""
        node = value.producer()
        if node is None or node.op_type != "Shape" or node.inputs[0] is not self.mask:
            return None
        return tuple(node.attributes[k].value if k in node.attributes else None for k in ("start", "end"))

    def _is_length(self, value) -> bool:
        """Whether `value` is `[S]`, the mask's second dimension."""
        return self._mask_dims(value) == (1, 2)

    def _with_length(self, shape):
        """`shape` (a Concat of constants, `[B]` and `[S]`) with the real tokens' count for `[S]`, or
        None if it is made otherwise."""
        node = shape.producer()
        if node is None or node.op_type != "Concat":
            return None
        batch_or_length = ((None, 1), (0, 1), (1, 2))
        if any(v.const_value is None and self._mask_dims(v) not in batch_or_length for v in node.inputs):
            return None
        if node not in self.lengths:
            inputs = [self.real if self._is_length(v) else v for v in node.inputs]
            copy = ir.Node("", "Concat", inputs, [ir.AttrInt64("axis", node.attributes["axis"].value)])
            self.model.graph.insert_after(node, [copy])
            self.lengths[node] = copy.outputs[0]
        return self.lengths[node]

    def project_rows_only(self, attention, index) -> bool:
        """Rewrites the chain that makes `attention`'s input `index` (key or value) from its projection
        `MatMul(x [B, S, E], W)` to run on `x`'s rows up to the batch's last real token, its output
        padded with zero rows to L (keys the bias masks: the same weights, exactly 0); returns
        whether it could. The chain must be the attention's alone; each of its other inputs must be
        a constant, a shape made of constants and the mask's dimensions, or a tensor with one axis of
        length S (the rotary embedding's cosines and sines), which is sliced likewise.

        Not to L itself: int8 graphs quantize each product's input with its own range, and the rows
        after the last real token are padding, whose values do not reach the real tokens' outputs
        and should not set their keys' range (`quantize.emulate_quantization` does the same)."""
        value = attention.inputs[index]
        projection = value.producer()
        for _ in range(24):  # up the first inputs to the projection
            if projection is None or not projection.inputs or projection.inputs[0] is None:
                return False
            if projection.op_type == "MatMul" and projection.inputs[1].is_initializer():
                break
            projection = projection.inputs[0].producer()
        else:
            return False
        x = projection.inputs[0]
        if x.shape is None or len(x.shape) != 3 or x.shape[1] != self.seq:
            return False
        chain, frontier, last = [], [projection.outputs[0]], value.producer()
        while frontier:  # forward from the projection to `value`
            for use in frontier.pop().uses():
                if use.node not in chain:
                    chain.append(use.node)
                    if len(chain) > 48:
                        return False
                    if use.node is not last:
                        frontier.extend(use.node.outputs)
        members = set(chain) | {projection}
        graph_outputs = set(self.model.graph.outputs)
        for node in chain:
            for out in node.outputs:
                users = {use.node for use in out.uses()}
                if out in graph_outputs or not users <= (members if node is not last else {attention}):
                    return False
        replacements = []  # (node, input index, what it reads instead)
        for node in chain:
            for i, inp in enumerate(node.inputs):
                if inp is None or inp.producer() in members or inp.const_value is not None:
                    continue
                if inp.type is not None and inp.type.dtype == ir.DataType.INT64:
                    shape = self._with_length(inp)
                    if shape is None:
                        return False
                    replacements.append((node, i, shape))
                    continue
                axes = [a for a, dim in enumerate(inp.shape or []) if dim == self.seq]
                if inp.shape is None or len(axes) > 1:
                    return False
                if axes:
                    replacements.append((node, i, (inp, axes[0])))
        for node, i, new in replacements:
            node.replace_input_with(i, self._real_rows(*new) if isinstance(new, tuple) else new)
        projection.replace_input_with(0, self._real_rows(x, 1))
        for node in [projection, *chain]:
            for out in node.outputs:
                if out.shape is not None:
                    out.shape = ir.Shape([ir.SymbolicDim(REAL_ROWS) if d == self.seq else d for d in out.shape])
        padded = ir.Node("", "Pad", [value, self.pads])  # [B, real, H*D] -> [B, L, H*D], zero rows
        self.model.graph.insert_after(last, [padded])
        attention.replace_input_with(index, padded.outputs[0])
        return True


def _insert_after_producer(model, value, nodes):
    """Inserts `nodes` right after `value`'s producer, or at the start of the graph for an input."""
    producer = value.producer()
    if producer is None:
        model.graph.insert_before(next(iter(model.graph)), nodes)
    else:
        model.graph.insert_after(producer, nodes)
