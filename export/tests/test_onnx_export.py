"""`onnx_export`: the exporter's optimizer without onnxscript's quadratic `SlicesSplit` rule writes
the same graph for the slicing it was written for (rotate_half's halves), and two exports of one
module are the same bytes."""

import os
import subprocess
import sys
from pathlib import Path

import onnx
import torch
from onnxscript import rewriter
from torch.export import Dim

from klein_export.onnx_export import SLICES_SPLIT, without_slices_split


class RotateHalf(torch.nn.Module):
    """transformers' rotate_half: the two halves of the last axis, swapped, the first negated."""

    def forward(self, x):  # [B, S, 8] -> [B, S, 8]
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _consts(node):
    return [None if i is None or i.const_value is None else i.const_value.numpy().tolist() for i in node.inputs]


def _nodes():
    """The optimised graph's nodes: operator and constant inputs."""
    x = torch.randn(2, 5, 8)
    shapes = {"x": {0: Dim("b"), 1: Dim("s")}}
    program = torch.onnx.export(RotateHalf().eval(), (x,), dynamo=True, dynamic_shapes=shapes, optimize=True)
    return [(node.op_type, _consts(node)) for node in program.model.graph]


def test_the_rule_is_left_out_only_inside():
    before = [r.name for r in rewriter._DEFAULT_REWRITE_RULES]
    assert SLICES_SPLIT in before
    with without_slices_split():
        assert [r.name for r in rewriter._DEFAULT_REWRITE_RULES] == [n for n in before if n != SLICES_SPLIT]
    assert [r.name for r in rewriter._DEFAULT_REWRITE_RULES] == before


def test_same_graph_with_and_without_the_rule():
    plain = _nodes()
    with without_slices_split():
        without = _nodes()
    assert without == plain
    assert [op for op, _ in plain].count("Slice") == 2, plain


EXPORT_ONE = """
import sys
import torch
from torch.export import Dim
from klein_export.contract import GraphIO, Tensor
from klein_export.onnx_export import export_graph
sys.path.insert(0, sys.argv[2])
from test_onnx_export import RotateHalf

io = GraphIO("test", "rotate.onnx", (Tensor("x", "float32", ("b", "s", 8)),), (Tensor("y", "float32", ("b", "s", 8)),))
shapes = {"x": {0: Dim("b"), 1: Dim("s")}}
export_graph(RotateHalf().eval(), (torch.randn(2, 5, 8),), shapes, io, sys.argv[1])
"""


def test_two_exports_are_the_same_bytes(tmp_path):
    """In processes with different string hashing, the saved graphs are byte-identical and carry no
    graph-level metadata: torch.export's range constraints, whose order followed the hashing in the
    tiny VAE encoder's graph (two exports differed in those bytes alone)."""
    files = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        out.mkdir()
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run(
            [sys.executable, "-c", EXPORT_ONE, str(out), str(Path(__file__).parent)],
            env=env,
            capture_output=True,
            text=True,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        files.append((out / "rotate.onnx").read_bytes())
    assert files[0] == files[1]
    assert not onnx.load_from_string(files[0]).graph.metadata_props


def test_transformer_carries_torchs_timestep_frequencies(tiny_bundle):
    """The folded `exp(-ln(10000) i / 128)` of the timestep embedding is torch's float32 result, not
    numpy's, which differs in the last bit of 55 of the 128 values (onnx_export.timestep_frequencies_as_torch)."""
    import math

    import numpy as np

    exponent = -math.log(10000) * torch.arange(0, 128, dtype=torch.float32) / 128
    torch_values, numpy_values = torch.exp(exponent).numpy(), np.exp(exponent.numpy())
    assert (torch_values != numpy_values).sum() > 0  # else this test proves nothing
    model = onnx.load(str(tiny_bundle / "transformer.onnx"), load_external_data=False)
    arrays = [onnx.numpy_helper.to_array(t).reshape(-1) for t in model.graph.initializer]
    arrays = [a for a in arrays if a.dtype == np.float32 and a.size == 128]
    assert any(np.array_equal(a, torch_values) for a in arrays)
    assert not any(np.array_equal(a, numpy_values) for a in arrays)
