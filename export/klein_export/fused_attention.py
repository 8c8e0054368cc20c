"""Attention as one fused operator in the transformer graph: `com.microsoft.MultiHeadAttention`.

The exporter otherwise writes diffusers' `scaled_dot_product_attention` as MatMul, Softmax and
MatMul, and ONNX Runtime then materialises every head's [tokens, tokens] score matrix (at
1024x1024, 24 x 4608 x 4608 floats, 2 GB per block). ONNX Runtime's CPU kernel of
MultiHeadAttention computes attention in blocks without that matrix (flash attention), and its
CUDA kernel runs flash or memory-efficient attention; both compute the same softmax(QK^T/sqrt(d))V.

The VAE's mid-block attention is left as it is: fused the same way, the wide checkpoint's decoder
at 1024x1024 ran at the same speed with a higher peak (5.65 against 4.81 GiB); at 1536x1536 its
peak rose too under ONNX Runtime's arena (17.4 against 14.7 GiB) and fell only without the arena,
where the decode was as slow as auto's tiles (benches/RESULTS.md, "Attention as one operator"); at 2048x2048
its convolutions alone do not fit in 24 GB either way (tiled decoding does).

While `fused_attention()` is active, these attention calls go through the custom op
`klein::attention` (its eager form is torch's own attention, so the traced model computes what
diffusers computes), which `TRANSLATIONS` writes as MultiHeadAttention.
"""

import contextlib
import importlib

import onnx
import onnxscript
import torch
from onnxscript import opset18 as op  # the exporter builds at 18, then converts


def _register_schema():
    """ONNX Runtime's MultiHeadAttention (its query, key, value, optional bias, key padding mask and
    attention bias, and output; the `num_heads` attribute) known to onnx.defs, so that onnxscript can
    write the node and ONNX's shape inference accepts the text encoder's (ort_fusions.fuse_for_ort),
    which takes the attention bias."""
    if onnx.defs.has("MultiHeadAttention", "com.microsoft"):
        return
    param = onnx.defs.OpSchema.FormalParameter
    optional = onnx.defs.OpSchema.FormalParameterOption.Optional
    schema = onnx.defs.OpSchema(
        "MultiHeadAttention",
        "com.microsoft",
        1,
        inputs=[
            param("query", "T"),
            param("key", "T"),
            param("value", "T"),
            param("bias", "T", param_option=optional),
            param("key_padding_mask", "M", param_option=optional),
            param("attention_bias", "T", param_option=optional),
        ],
        outputs=[param("output", "T")],
        type_constraints=[
            ("T", ["tensor(float)", "tensor(float16)"], "float tensors"),
            ("M", ["tensor(int32)"], "key padding mask"),
        ],
        attributes=[onnx.defs.OpSchema.Attribute("num_heads", onnx.defs.OpSchema.AttrType.INT, "heads")],
    )
    onnx.defs.register_schema(schema)


_register_schema()
MSFT = onnxscript.values.Opset("com.microsoft", 1)


@torch.library.custom_op("klein::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Attention over `[B, S, H, D]` query and `[B, L, H, D]` key/value (diffusers' layout)."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # -> [B, H, S, D]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).contiguous()


@attention.register_fake
def _(query, key, value, num_heads):
    return torch.empty_like(query)


def _attention_onnx(query, key, value, num_heads: int):
    """`[B, S, H, D]` -> `[B, S, H*D]` each, MultiHeadAttention, back to `[B, S, H, D]`."""

    def flat(x):
        # The last size is computed, not -1: a Reshape cannot infer -1 of an empty tensor (the KV
        # graph's zero-length reference tokens, kv_cache.py).
        shape = op.Shape(x)
        first_two = op.Slice(shape, op.Constant(value_ints=[0]), op.Constant(value_ints=[2]))
        heads, dim = (op.Slice(shape, op.Constant(value_ints=[i]), op.Constant(value_ints=[i + 1])) for i in (2, 3))
        return op.Reshape(x, op.Concat(first_two, op.Mul(heads, dim), axis=0))

    out = MSFT.MultiHeadAttention(flat(query), flat(key), flat(value), num_heads=num_heads)
    return op.Reshape(out, op.Shape(query))


TRANSLATIONS = {torch.ops.klein.attention.default: _attention_onnx}
OPSETS = {"com.microsoft": 1}


@contextlib.contextmanager
def fused_attention(half: bool = False, family: str = "flux2"):
    """Routes the `family` transformer's unmasked attention (diffusers' `dispatch_attention_fn` in
    `transformer_flux2` or `transformer_flux3`) through `klein::attention`. `half` (fp16 bundles):
    query, key and value are cast to float16 and the output back, so that the graph's
    MultiHeadAttention runs in float16, the form ONNX Runtime's CUDA provider runs as flash attention
    (its float32 kernel is the slower memory-efficient one)."""
    module = importlib.import_module(f"diffusers.models.transformers.transformer_{family}")
    original = module.dispatch_attention_fn

    def dispatch(query, key, value, attn_mask=None, **kwargs):
        if attn_mask is not None:
            return original(query, key, value, attn_mask=attn_mask, **kwargs)
        if not half:
            return torch.ops.klein.attention(query, key, value, query.shape[2])
        q, k, v = (t.to(torch.float16) for t in (query, key, value))
        return torch.ops.klein.attention(q, k, v, query.shape[2]).to(query.dtype)

    module.dispatch_attention_fn = dispatch
    try:
        yield
    finally:
        module.dispatch_attention_fn = original
