"""Graph precision: fp32, or fp16 matrix products with everything else kept in fp32.

`--precision fp16` stores the weights of the matrix products (every `nn.Linear` and `nn.Conv2d`, and
the text encoder's embedding table) in float16 and computes those products in float16. Everything
between them stays float32: the residual stream, every norm (LayerNorm, RMSNorm, GroupNorm), the
modulation (timestep embedder, shift/scale/gate projections, the final AdaLayerNorm), attention
(scores, softmax, weighted sum) and RoPE. One exception: the fused attention of dynamic-shape
transformers runs in float16 (fused_attention.py, `half`), the form CUDA runs as flash attention.
Each converted module is wrapped in a `Float16Island`, which casts its floating input to float16 and
its output back to float32, so every graph keeps the float32 inputs and outputs of the contract and
the dynamo exporter sees an ordinary torch module (rewriting the exported graph with onnx's
`float16.convert_float_to_float16` breaks dynamo graphs).

Why these and not more: see `measure_ranges` (forward hooks on the diffusers pipeline) and the
"Precision and quantization" section of onnx/README.md. In short, diffusers itself clips the Flux2
residual stream to +-65504 when it runs in float16 (`Flux2TransformerBlock.forward`), decoder LMs'
residual streams carry "massive activations" of the order of 1e3-1e4, and the modulation multiplies
normalised activations by `1 + scale`, so an error there scales every token. Random-weight checkpoints
stay far inside the float16 range, so `klein-export ranges` is the tool to re-check a real one.

bfloat16 is refused: ONNX Runtime's CPU provider has no bfloat16 kernels for MatMul, Gemm, Add, Mul,
Softmax or Sigmoid (checked with `bfloat16_support()`), so a bf16 bundle would not run where the
tests and the runtime's default provider run.
"""

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from .errors import PrecisionError
from .options import PRECISIONS  # noqa: F401 (used below, and imported from here)

FLOAT16_MAX = 65504.0

# Module types whose weights and products go to float16.
HALF_TYPES = (nn.Linear, nn.Conv2d, nn.Embedding)

# Modules of those types that stay float32 anyway, by dotted name segment, with the reason.
# Names are those of the export wrappers (wrappers.py): `transformer.*`, `model.*`, `vae.*`.
KEEP_FLOAT32 = {
    "transformer": {
        "time_guidance_embed": "timestep embedder: sin/cos of sigma*1000 feeds the modulation",
        "double_stream_modulation_img": "modulation: shift/scale/gate of every double block (image stream)",
        "double_stream_modulation_txt": "modulation: shift/scale/gate of every double block (text stream)",
        "single_stream_modulation": "modulation: shift/scale/gate of every single block",
        "norm_out": "final AdaLayerNorm modulation (scale/shift of the output)",
    },
    "flux3_transformer": {
        "timestep_embedder": "timestep embedder: sin/cos of t*1000 feeds every modulation",
        "target_timestep_embedder": "target-timestep embedder (flow map): added to every modulation",
        "early_stream_modulations": "modulation: shift/scale/gate of the per-mode blocks",
        "single_stream_modulations": "modulation: shift/scale/gate of the joint blocks",
        "norm_out": "final AdaLayerNorm modulation (scale/shift of the output)",
    },
    "text_encoder": {},
    "vae": {},
}


class Float16Island(nn.Module):
    """Runs `module` in float16 between float32 activations: cast in, compute, cast out."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module.to(torch.float16)

    def forward(self, x):
        if x.is_floating_point():
            x = x.to(torch.float16)
        return self.module(x).to(torch.float32)


@dataclass
class PrecisionScheme:
    """What `to_float16` converted and what it kept in float32 (for the manifest)."""

    precision: str
    float16_modules: list = field(default_factory=list)
    kept_float32: dict = field(default_factory=dict)  # module name -> reason

    def subset(self, prefixes: tuple) -> "PrecisionScheme":
        """The part of the scheme under the given module-name prefixes (one graph of a shared module)."""
        return PrecisionScheme(
            self.precision,
            [n for n in self.float16_modules if n.startswith(prefixes)],
            {n: r for n, r in self.kept_float32.items() if n.startswith(prefixes)},
        )

    def to_json(self, half_attention: bool = False) -> dict:
        """`half_attention`: the graph's fused attention runs in float16 (the transformer of dynamic-shape
        bundles, fused_attention.py), the rest as the scheme says."""
        attention = "" if half_attention else "attention scores and softmax, "
        scheme = {
            "float16": sorted({_pattern(n) for n in self.float16_modules}),
            "float16_module_count": len(self.float16_modules),
            "kept_float32": {_pattern(n): reason for n, reason in sorted(self.kept_float32.items())},
            "float32_ops": f"everything else: residual stream, norms, modulation, {attention}RoPE, graph I/O",
        }
        if half_attention:
            scheme["float16_ops"] = "attention (MultiHeadAttention: query, key and value cast to float16)"
        return scheme


def _pattern(name: str) -> str:
    """`transformer.transformer_blocks.3.attn.to_q` -> `transformer.transformer_blocks.*.attn.to_q`."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _keep_reason(name: str, keep: dict):
    padded = f".{name}."
    return next((reason for key, reason in keep.items() if f".{key}." in padded), None)


def to_float16(module: nn.Module, component: str) -> PrecisionScheme:
    """Converts `module` in place: every HALF_TYPES submodule not kept float32 becomes a Float16Island.

    `component` is "text_encoder", "transformer" (FLUX.2's), "flux3_transformer" or "vae" (the VAE's
    encoder and decoder share one module, converted once). Modules already inside an island are left
    alone, so a second call on the same module converts nothing more.
    """
    keep = KEEP_FLOAT32[component]
    scheme = PrecisionScheme("fp16")

    def visit(parent: nn.Module, prefix: str):
        for child_name, child in list(parent.named_children()):
            name = prefix + child_name
            if isinstance(child, Float16Island):
                continue
            if isinstance(child, HALF_TYPES):
                reason = _keep_reason(name, keep)
                if reason is None:
                    parent._modules[child_name] = Float16Island(child)  # same slot: parameter order kept
                    scheme.float16_modules.append(name)
                else:
                    scheme.kept_float32[name] = reason
            else:
                visit(child, name + ".")

    visit(module, "")
    return scheme


def bfloat16_support():
    """None when ONNX Runtime's CPU provider runs a bfloat16 MatMul, else the reason it does not."""
    import ml_dtypes
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 2])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    try:
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        sess.run(None, {"x": np.ones((2, 2), ml_dtypes.bfloat16)})
    except Exception as e:  # ORT raises its own exception types
        return str(e).strip().splitlines()[0]
    return None


def check_precision(precision: str):
    """Raises PrecisionError for a precision this exporter does not write."""
    if precision not in PRECISIONS:
        raise PrecisionError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "bf16":
        import onnxruntime as ort

        reason = bfloat16_support()
        detail = (
            f"ONNX Runtime {ort.__version__}'s CPU provider: {reason}"
            if reason
            else f"ONNX Runtime {ort.__version__} now runs a bfloat16 MatMul on CPU, "
            "but klein-export has no tested bf16 path yet"
        )
        raise PrecisionError(f"--precision bf16 is refused ({detail}); use --precision fp16")


# ---------------------------------------------------------------------------------------------------
# Measuring activation ranges


@dataclass
class Range:
    """Largest |value| a module saw and produced over a whole pipeline run."""

    component: str
    name: str
    kind: str
    max_in: float = 0.0
    max_out: float = 0.0

    @property
    def pattern(self) -> str:
        return _pattern(self.name)


def _max_abs(value) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().abs().max()) if value.is_floating_point() and value.numel() else 0.0
    if isinstance(value, (tuple, list)):
        return max((_max_abs(v) for v in value), default=0.0)
    if hasattr(value, "values") and callable(value.values):  # ModelOutput / dict
        return max((_max_abs(v) for v in value.values()), default=0.0)
    return 0.0


class _AttentionLogits(torch.overrides.TorchFunctionMode):
    """Records max |q.k * scale| of every scaled_dot_product_attention call (the softmax input)."""

    def __init__(self):
        super().__init__()
        self.component = None
        self.max_logit = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and self.component:
            q = args[0] if len(args) > 0 else kwargs["query"]
            k = args[1] if len(args) > 1 else kwargs["key"]
            if k.shape[-3] != q.shape[-3]:  # grouped-query attention: repeat the key heads
                k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            scale = kwargs.get("scale") or q.shape[-1] ** -0.5
            logits = float((q @ k.transpose(-2, -1)).abs().max()) * scale  # the mode is off inside here
            self.max_logit[self.component] = max(self.max_logit.get(self.component, 0.0), logits)
        return func(*args, **kwargs)


def measure_ranges(checkpoint, steps=2, size=64, prompt="a raccoon astronaut on the moon", seed=0, with_reference=True):
    """Runs diffusers' Flux2KleinPipeline in float32 with forward hooks on every module.

    Returns one Range per module of the text encoder, transformer and VAE (max |input| and max |output|
    over the whole run: every denoising step, the VAE encoder on a reference image when
    `with_reference`, and the decode), plus one Range per component named `<attention logits>` with
    the largest softmax input of its scaled-dot-product attentions. Block outputs are the residual
    stream.
    """
    from .checkpoint import Checkpoint
    from .diffusers_reference import diffusers_image, load_pipeline
    from .fixtures import synthetic_image

    layers = Checkpoint(checkpoint).text_encoder_out_layers
    pipe = load_pipeline(checkpoint)
    ranges, handles = {}, []
    logits = _AttentionLogits()

    def hook(key):
        def record(_module, args, kwargs, output):
            r = ranges[key]
            r.max_in = max(r.max_in, _max_abs(args), _max_abs(kwargs))
            r.max_out = max(r.max_out, _max_abs(output))

        return record

    def enter(component):
        def pre(_module, _args):
            logits.component = component

        return pre

    for component, model in (("text_encoder", pipe.text_encoder), ("transformer", pipe.transformer), ("vae", pipe.vae)):
        handles.append(model.register_forward_pre_hook(enter(component)))
        for name, module in model.named_modules():
            if not name:
                continue
            ranges[(component, name)] = Range(component, name, type(module).__name__)
            handles.append(module.register_forward_hook(hook((component, name)), with_kwargs=True))
    try:
        image = [synthetic_image(size, size, "RGB", seed=seed)] if with_reference else None
        with logits:
            diffusers_image(pipe, prompt, seed, size, size, steps, image=image, out_layers=layers)
    finally:
        for h in handles:
            h.remove()
    out = [r for r in ranges.values() if r.max_out or r.max_in]
    out += [Range(c, "<attention logits>", "softmax input", 0.0, v) for c, v in logits.max_logit.items()]
    return out


def summarise_ranges(ranges, top=40):
    """Groups modules by name pattern (layer indices folded) and returns the largest, as text lines."""
    groups = {}
    for r in ranges:
        key = (r.component, r.pattern, r.kind)
        g = groups.setdefault(key, [0.0, 0.0])
        g[0], g[1] = max(g[0], r.max_in), max(g[1], r.max_out)
    rows = sorted(groups.items(), key=lambda kv: -max(kv[1]))[:top]
    lines = [f"{'component':12s} {'module':58s} {'type':28s} {'max|in|':>10s} {'max|out|':>10s} {'fp16 headroom':>13s}"]
    for (component, pattern, kind), (max_in, max_out) in rows:
        peak = max(max_in, max_out)
        headroom = FLOAT16_MAX / peak if peak else float("inf")
        flag = "  OVERFLOW" if peak > FLOAT16_MAX else ""
        lines.append(f"{component:12s} {pattern:58s} {kind:28s} {max_in:10.3g} {max_out:10.3g} {headroom:12.3g}x{flag}")
    return lines
