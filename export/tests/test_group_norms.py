"""The VAE's group norms as LayerNormalization (ort_fusions.group_norms_as_layer_norms): the same
values as torch's GroupNorm at any size, and no Shape of the normalised tensor left, so that a
statically quantized graph does not dequantize a tensor only for its shape."""

import numpy as np
import onnx
import onnxruntime as ort
import torch

from klein_export import contract
from klein_export.onnx_export import export_graph
from klein_export.ort_fusions import group_norms_as_layer_norms


class Block(torch.nn.Module):
    """GroupNorm -> SiLU -> Conv, twice with a residual: a VAE resnet's shape."""

    def __init__(self, channels=64, groups=32):
        super().__init__()
        torch.manual_seed(0)
        self.norm1 = torch.nn.GroupNorm(groups, channels, eps=1e-6)
        self.conv1 = torch.nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = torch.nn.GroupNorm(groups, channels, eps=1e-6)
        self.conv2 = torch.nn.Conv2d(channels, channels, 3, padding=1)
        for norm in (self.norm1, self.norm2):  # not the identity affine
            torch.nn.init.normal_(norm.weight)
            torch.nn.init.normal_(norm.bias)

    def forward(self, x):
        h = self.conv1(torch.nn.functional.silu(self.norm1(x)))
        return x + self.conv2(torch.nn.functional.silu(self.norm2(h)))


def _export(tmp_path, fuse):
    io = contract.GraphIO(
        "vae_decoder",
        "block.onnx",
        (contract.Tensor("x", "float32", ("batch", 64, "h", "w")),),
        (contract.Tensor("y", "float32", ("batch", 64, "h", "w")),),
    )
    b = torch.export.Dim("batch", min=1, max=8)
    h, w = torch.export.Dim("h", min=2, max=512), torch.export.Dim("w", min=2, max=512)
    x = torch.randn(2, 64, 6, 8)
    out = tmp_path / ("fused" if fuse else "plain")
    out.mkdir()
    path, fusions = export_graph(Block().eval(), (x,), {"x": {0: b, 2: h, 3: w}}, io, out, fuse=fuse)
    return path, fusions


def test_layer_norms_give_torch_group_norms_at_any_size(tmp_path):
    """Max abs difference from torch's float64 GroupNorm block no larger than the plain export's
    InstanceNormalization (the same float32 arithmetic otherwise; 1e-4 on outputs of a few units)."""
    fused, fusions = _export(tmp_path, group_norms_as_layer_norms)
    plain, _ = _export(tmp_path, None)
    assert fusions == {"group_norms_as_layer_norms": 2}
    ops = [n.op_type for n in onnx.load(fused).graph.node]
    assert ops.count("LayerNormalization") == 2 and "InstanceNormalization" not in ops
    block = Block().double().eval()
    for shape in [(1, 64, 6, 8), (2, 64, 37, 21)]:
        x = np.random.default_rng(shape[2]).standard_normal(shape).astype(np.float32) * 3 + 2
        with torch.no_grad():
            reference = block(torch.from_numpy(x).double()).numpy()
        errors = {}
        for name, path in (("fused", fused), ("plain", plain)):
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            errors[name] = np.abs(session.run(None, {"x": x})[0] - reference).max()
        assert errors["fused"] <= max(errors["plain"] * 1.5, 1e-5), errors
        assert errors["fused"] < 1e-4, errors


def test_no_shape_reads_the_normalised_input(tmp_path):
    """The plain export takes Shape of each group norm's input (to reshape back); the rewrite reshapes
    with constants, so no Shape reads a convolution's output."""
    fused, _ = _export(tmp_path, group_norms_as_layer_norms)
    plain, _ = _export(tmp_path, None)

    def shapes_of_conv_outputs(path):
        graph = onnx.load(path).graph
        conv_outputs = {n.output[0] for n in graph.node if n.op_type == "Conv"}
        return sum(1 for n in graph.node if n.op_type == "Shape" and n.input[0] in conv_outputs)

    assert shapes_of_conv_outputs(plain) >= 1
    assert shapes_of_conv_outputs(fused) == 0
