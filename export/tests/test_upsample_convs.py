"""The VAE decoder's upsamplers as four 2x2 phase convolutions (upsample_convs.py): the same values
as diffusers' `Upsample2D` (nearest 2x, then a 3x3 convolution) at any size, odd ones included, and
no Resize left."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from diffusers.models.upsampling import Upsample2D

from klein_export import contract
from klein_export.onnx_export import export_graph
from klein_export.upsample_convs import phase_kernels, upsamplers_as_phase_convs

CHANNELS = 16


def _upsampler():
    torch.manual_seed(0)
    block = Upsample2D(CHANNELS, use_conv=True, out_channels=CHANNELS + 8)
    torch.nn.init.normal_(block.conv.bias)  # not zero: each phase must add it once
    return block.eval()


def _export(tmp_path, fuse):
    io = contract.GraphIO(
        "vae_decoder",
        "up.onnx",
        (contract.Tensor("x", "float32", ("batch", CHANNELS, "h", "w")),),
        (contract.Tensor("y", "float32", ("batch", CHANNELS + 8, "2h", "2w")),),
    )
    b = torch.export.Dim("batch", min=1, max=8)
    h, w = torch.export.Dim("h", min=2, max=512), torch.export.Dim("w", min=2, max=512)
    out = tmp_path / ("fused" if fuse else "plain")
    out.mkdir()
    return export_graph(
        _upsampler(), (torch.randn(2, CHANNELS, 6, 8),), {"hidden_states": {0: b, 2: h, 3: w}}, io, out, fuse=fuse
    )


def test_phase_convolutions_give_the_upsampler_at_any_size(tmp_path):
    """Max abs difference from diffusers' Upsample2D in float64 no larger than the plain export's
    (Resize + 3x3 Conv in float32) by more than float32 rounding of outputs of a few units: the
    rewrite sums up to four taps before multiplying, so its rounding differs, not its size."""
    fused, fusions = _export(tmp_path, upsamplers_as_phase_convs)
    plain, _ = _export(tmp_path, None)
    assert fusions == {"upsamplers_as_phase_convs": 1}
    nodes = onnx.load(fused).graph.node
    ops = [n.op_type for n in nodes]
    assert "Resize" not in ops and ops.count("DepthToSpace") == 1
    kernels = [list(a.ints) for n in nodes if n.op_type == "Conv" for a in n.attribute if a.name == "kernel_shape"]
    assert kernels == [[2, 2]] * 4
    block = _upsampler().double()
    for shape in [(1, CHANNELS, 2, 2), (2, CHANNELS, 7, 5), (1, CHANNELS, 33, 64)]:
        x = np.random.default_rng(shape[2]).standard_normal(shape).astype(np.float32) * 3
        with torch.no_grad():
            reference = block(torch.from_numpy(x).double()).numpy()
        errors = {}
        for name, path in (("fused", fused), ("plain", plain)):
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            y = session.run(None, {"x": x})[0]
            assert y.shape == reference.shape
            errors[name] = np.abs(y - reference).max()
        assert errors["fused"] <= max(errors["plain"] * 2, 1e-5), errors
        assert errors["fused"] < 1e-4, errors


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_phase_kernels_sum_the_taps_each_phase_sees(dtype):
    """Each phase kernel, applied where the phase's pixels lie, equals the 3x3 kernel applied to the
    upsampled image; checked tap by tap with a one-hot source, in the weight's own dtype."""
    w = np.random.default_rng(1).standard_normal((3, 2, 3, 3)).astype(dtype)
    kernels = phase_kernels(w)
    assert [k.dtype for k in kernels] == [np.dtype(dtype)] * 4
    # Output pixel (2i + a, 2j + b) of a one-hot source at (i + di, j + dj), di, dj in {-1, 0, 1}:
    # the 3x3 taps whose upsampled row 2i + a + dy - 1 lies in source row i + di, summed.
    for index, kernel in enumerate(kernels):
        a, b = divmod(index, 2)
        for u in (0, 1):
            for v in (0, 1):
                di, dj = u - 1 + a, v - 1 + b  # the source pixel tap (u, v) reads, relative to (i, j)
                rows = [dy for dy in range(3) if (2 * 10 + a + dy - 1) // 2 == 10 + di]
                cols = [dx for dx in range(3) if (2 * 10 + b + dx - 1) // 2 == 10 + dj]
                expected = w.astype(np.float64)[:, :, rows][:, :, :, cols].sum(axis=(2, 3))
                np.testing.assert_allclose(kernel[:, :, u, v], expected, rtol=1e-3 if dtype == np.float16 else 1e-6)
