"""One `com.microsoft.MultiHeadAttention` node in float32 and in float16 on ONNX Runtime's CPU provider.

The transformer of fp16 bundles runs its attention in float16 (export/klein_export/fused_attention.py,
`half`): this measures what that costs on the CPU, where fp16 bundles can also run. A synthetic
one-node graph per dtype, query/key/value [1, tokens, heads*dim] of random values, one untimed run,
then the median of `--reps` runs. The float32 rate (4 tokens^2 heads dim operations) compares
with `benches/products.py`'s fp32 MatMul on the same host.

    python benches/attention.py --tokens 1536 --tokens 4608 [--heads 24 --dim 128 --threads 2 --reps 3]
"""

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort

from onnx import TensorProto, helper

DTYPES = {"fp32": (TensorProto.FLOAT, np.float32), "fp16": (TensorProto.FLOAT16, np.float16)}


def attention_graph(elem_type: int, tokens: int, heads: int, dim: int) -> bytes:
    """q, k, v [1, tokens, heads*dim] -> MultiHeadAttention -> o."""
    shape = [1, tokens, heads * dim]
    inputs = [helper.make_tensor_value_info(name, elem_type, shape) for name in "qkv"]
    output = helper.make_tensor_value_info("o", elem_type, shape)
    node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft", num_heads=heads)
    graph = helper.make_graph([node], "attention", inputs, [output])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def seconds(dtype: str, tokens: int, heads: int, dim: int, threads: int, reps: int) -> float:
    elem_type, np_dtype = DTYPES[dtype]
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(attention_graph(elem_type, tokens, heads, dim), options, ["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {name: (rng.standard_normal((1, tokens, heads * dim)) * 0.5).astype(np_dtype) for name in "qkv"}
    session.run(None, feeds)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, action="append", help="sequence lengths (default 1536 and 4608)")
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    for tokens in a.tokens or [1536, 4608]:
        s = {d: seconds(d, tokens, a.heads, a.dim, a.threads, a.reps) for d in DTYPES}
        flops = 4 * tokens * tokens * a.heads * a.dim  # Q K^T and P V, 2 operations per multiply-add
        print(
            f"{tokens} tokens: fp32 {s['fp32']:.3f} s ({flops / s['fp32'] / 1e9:.1f} GOP/s), "
            f"fp16 {s['fp16']:.3f} s ({s['fp16'] / s['fp32']:.2f}x)"
        )


if __name__ == "__main__":
    main()
