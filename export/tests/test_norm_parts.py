"""The statically quantized decoder's group norms in channel parts (norm_parts.py): the same outputs
bit for bit as the whole norms, as ONNX Runtime runs them, and no float tensor of a whole norm left."""

import collections

import numpy as np
import onnx
import onnxruntime as ort
import torch

from klein_export import contract
from klein_export.norm_parts import PARTS, group_norms_in_parts
from klein_export.onnx_export import export_graph
from klein_export.ort_fusions import group_norms_as_layer_norms
from klein_export.quantize import _shapes_of_codes, _static_convs

CHANNELS, GROUPS = 64, 16


class Tail(torch.nn.Module):
    """A decoder's last resnet and output: GroupNorm -> SiLU -> Conv twice with a residual (integer
    convolutions once quantized), then GroupNorm -> SiLU -> the 3-channel RGB Conv (stays float)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.norms = torch.nn.ModuleList(torch.nn.GroupNorm(GROUPS, CHANNELS, eps=1e-6) for _ in range(3))
        self.convs = torch.nn.ModuleList(torch.nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1) for _ in range(2))
        self.rgb = torch.nn.Conv2d(CHANNELS, 3, 3, padding=1)
        for norm in self.norms:  # not the identity affine: a part given another part's factors shows
            torch.nn.init.normal_(norm.weight)
            torch.nn.init.normal_(norm.bias)

    def forward(self, latents):
        silu = torch.nn.functional.silu
        h = self.convs[0](silu(self.norms[0](latents)))
        h = latents + self.convs[1](silu(self.norms[1](h)))
        return self.rgb(silu(self.norms[2](h)))


def _static(tmp_path):
    """The tail exported as the decoder is (group norms as LayerNormalization) and quantized by
    `--method static`'s steps up to the parts: (the graph with whole norms, the graph in parts, count)."""
    io = contract.GraphIO(
        "vae_decoder",
        "tail.onnx",
        (contract.Tensor("latents", "float32", ("batch", CHANNELS, "h", "w")),),
        (contract.Tensor("image", "float32", ("batch", 3, "h", "w")),),
    )
    dims = {0: torch.export.Dim("batch", min=1, max=8), 2: torch.export.Dim("h", min=2, max=512)}
    dims[3] = torch.export.Dim("w", min=2, max=512)
    x = torch.randn(2, CHANNELS, 6, 8)
    path, _ = export_graph(Tail().eval(), (x,), {"latents": dims}, io, tmp_path, fuse=group_norms_as_layer_norms)
    rng = np.random.default_rng(1)
    calibration = [rng.standard_normal((1, CHANNELS, 16, 16)).astype(np.float32) * 2 for _ in range(2)]
    whole = _static_convs(path, calibration, reduce_range=True)
    _shapes_of_codes(whole)
    parts = onnx.ModelProto()
    parts.CopyFrom(whole)
    return whole, parts, group_norms_in_parts(parts)


def _run(model, x):
    """ONNX Runtime's CPU provider with every optimisation (as klein runs the decoder), 2 threads."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"latents": x})[0]


def test_parts_give_the_whole_norms_outputs_bit_for_bit(tmp_path):
    whole, parts, count = _static(tmp_path)
    assert count == 3
    onnx.checker.check_model(parts, full_check=True)
    for shape in [(1, CHANNELS, 16, 16), (2, CHANNELS, 37, 21)]:
        x = np.random.default_rng(shape[2]).standard_normal(shape).astype(np.float32) * 2
        expected, got = _run(whole, x), _run(parts, x)
        assert np.abs(expected).max() > 0.1  # not a vanishing output
        assert np.array_equal(got, expected), np.abs(got - expected).max()


def test_no_whole_norm_is_left(tmp_path):
    """Each LayerNormalization normalises GROUPS / PARTS groups; the quantized convolutions read
    their parts' uint8 codes concatenated, the RGB conv its float parts; nothing of the whole chains
    (their affine factors, shapes, dequantizations) is left in the file."""
    whole, parts, _ = _static(tmp_path)
    made_by = {o: n for n in parts.graph.node for o in n.output}
    constants = {i.name: onnx.numpy_helper.to_array(i) for i in parts.graph.initializer}
    norms = [n for n in parts.graph.node if n.op_type == "LayerNormalization"]
    assert len(norms) == 3 * PARTS
    assert {int(constants[made_by[n.input[0]].input[1]][1]) for n in norms} == {GROUPS // PARTS}
    concats = [n for n in parts.graph.node if n.op_type == "Concat"]
    ends = collections.Counter(made_by[i].op_type for n in concats for i in n.input)
    assert ends == {"QuantizeLinear": 2 * PARTS, "Mul": PARTS}, ends  # two uint8 ends, one float (SiLU)
    rgb = next(n for n in parts.graph.node if n.op_type == "Conv" and n.input[1] in constants)  # float weight
    assert made_by[rgb.input[0]].op_type == "Concat"
    read = {name for n in parts.graph.node for name in n.input}
    assert all(i.name in read for i in parts.graph.initializer)
    whole_ops = collections.Counter(n.op_type for n in whole.graph.node)
    parts_ops = collections.Counter(n.op_type for n in parts.graph.node)
    # Every chain's input is sliced; the one that read a per-tensor DequantizeLinear (the second: the
    # first reads the graph's input, the third the residual sum) slices the uint8 codes instead and
    # dequantizes each part, and the whole's DequantizeLinear is gone.
    assert parts_ops["Slice"] - whole_ops["Slice"] == 3 * PARTS
    assert parts_ops["DequantizeLinear"] - whole_ops["DequantizeLinear"] == PARTS - 1


def test_a_chain_read_elsewhere_stays_whole(tmp_path):
    """A chain value read by more than the next node of the chain (here the second norm's shifted
    output, also a graph output) keeps that chain whole; the others are rewritten and the outputs
    stay equal."""
    whole, _, _ = _static(tmp_path)
    norm = [n for n in whole.graph.node if n.op_type == "LayerNormalization"][1]
    read_by = {name: n for n in whole.graph.node for name in n.input}
    shifted = read_by[read_by[read_by[norm.output[0]].output[0]].output[0]].output[0]  # back, Mul, Add
    whole.graph.output.append(onnx.helper.make_tensor_value_info(shifted, onnx.TensorProto.FLOAT, [None] * 4))
    parts = onnx.ModelProto()
    parts.CopyFrom(whole)
    assert group_norms_in_parts(parts) == 2
    onnx.checker.check_model(parts, full_check=True)
    assert norm in parts.graph.node
    x = np.random.default_rng(0).standard_normal((1, CHANNELS, 16, 16)).astype(np.float32)
    options = ort.SessionOptions()
    runs = [ort.InferenceSession(m.SerializeToString(), options).run(None, {"latents": x}) for m in (whole, parts)]
    assert all(np.array_equal(a, b) for a, b in zip(*runs, strict=True))
