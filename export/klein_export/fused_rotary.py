"""Rotary position embedding as one fused operator in the transformer graph:
`com.microsoft.RotaryEmbedding`.

The exporter otherwise writes diffusers' `apply_rotary_emb` (Flux2's interleaved form) as a Reshape,
two Slices and Squeezes, a Neg, an Unsqueeze-Concat "stack", another Reshape, two Muls and an Add,
for the query and the key of every block: a dozen passes over [tokens, heads x 128] floats where
ONNX Runtime's kernel makes one. Both compute, for each pair (x[2i], x[2i+1]) of a head,
(x[2i] cos - x[2i+1] sin, x[2i] sin + x[2i+1] cos); Flux2's cos and sin repeat each value for the
two members of a pair (`repeat_interleave_real`), so the kernel takes every other column.

While `fused_rotary()` is active, those calls go through the custom op `klein::rotary` (its eager
form is diffusers' own function, so the traced model computes what diffusers computes), which
`TRANSLATIONS` writes as RotaryEmbedding.
"""

import contextlib
import importlib

import onnx
import torch
from onnxscript import opset18 as op  # the exporter builds at 18, then converts

from .fused_attention import MSFT


def _register_schema():
    """ONNX Runtime's RotaryEmbedding (input, position ids, cos and sin caches; the `interleaved`
    and `num_heads` attributes) known to onnx.defs, so that onnxscript can write the node."""
    if onnx.defs.has("RotaryEmbedding", "com.microsoft"):
        return
    param = onnx.defs.OpSchema.FormalParameter
    attr = onnx.defs.OpSchema.Attribute
    schema = onnx.defs.OpSchema(
        "RotaryEmbedding",
        "com.microsoft",
        1,
        inputs=[param("input", "T"), param("position_ids", "M"), param("cos_cache", "T"), param("sin_cache", "T")],
        outputs=[param("output", "T")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)"], "float tensors"),
            ("M", ["tensor(int64)"], "positions"),
        ],
        attributes=[
            attr("interleaved", onnx.defs.OpSchema.AttrType.INT, "pairs adjacent (1) or halves (0)"),
            attr("num_heads", onnx.defs.OpSchema.AttrType.INT, "heads"),
        ],
    )
    onnx.defs.register_schema(schema)


_register_schema()


@torch.library.custom_op("klein::rotary", mutates_args=())
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Flux2's rotary embedding of `[B, S, H, D]` by `[S, D]` cos and sin (diffusers' function)."""
    from diffusers.models.embeddings import apply_rotary_emb

    return apply_rotary_emb(x, (cos, sin), sequence_dim=1).contiguous()


@rotary.register_fake
def _(x, cos, sin):
    return torch.empty_like(x)


def _rotary_onnx(x, cos, sin):
    """`[B, S, H, D]` -> `[B, S, H*D]`, RotaryEmbedding over positions 0..S-1 with the even
    columns of cos and sin (`[S, D/2]`, in x's type), back to `[B, S, H, D]`."""
    shape = op.Shape(x)
    first_two = op.Slice(shape, op.Constant(value_ints=[0]), op.Constant(value_ints=[2]))
    heads, dim = (op.Slice(shape, op.Constant(value_ints=[i]), op.Constant(value_ints=[i + 1])) for i in (2, 3))
    flat = op.Reshape(x, op.Concat(first_two, op.Mul(heads, dim), axis=0))

    def even_columns(t):
        columns = op.Slice(
            t,
            op.Constant(value_ints=[0]),
            op.Constant(value_ints=[2**62]),
            op.Constant(value_ints=[1]),
            op.Constant(value_ints=[2]),
        )
        return op.CastLike(columns, x)

    start = op.Constant(value_ints=[0])  # 1-D position ids: an offset, token s reads row s
    out = MSFT.RotaryEmbedding(flat, start, even_columns(cos), even_columns(sin), interleaved=1, num_heads=0)
    return op.Reshape(out, shape)


TRANSLATIONS = {torch.ops.klein.rotary.default: _rotary_onnx}


@contextlib.contextmanager
def fused_rotary(family: str = "flux2"):
    """Routes the `family` transformer's (`transformer_flux2`'s or `transformer_flux3`'s) rotary
    embeddings (diffusers' `apply_rotary_emb` with real
    cos and sin, pairs adjacent, sequence in dimension 1) through `klein::rotary`."""
    module = importlib.import_module(f"diffusers.models.transformers.transformer_{family}")
    original = module.apply_rotary_emb

    def apply(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
        if use_real and use_real_unbind_dim == -1 and sequence_dim == 1 and isinstance(freqs_cis, tuple):
            return torch.ops.klein.rotary(x, *freqs_cis)
        return original(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)

    module.apply_rotary_emb = apply
    try:
        yield
    finally:
        module.apply_rotary_emb = original
