"""One matrix product's speed in each of ONNX Runtime's CPU kernels a bundle can use, on this host
(or on the AVX2 host benches/avx2-host.sh makes of it): which kernel wins where (issue 15, target 7).

    python benches/products.py [--shape M,K,N] [--threads 1] [--reps 5]
    benches/avx2-host.sh python benches/products.py

Kernels: fp32 `MatMul` (fp32 bundles); `DynamicQuantizeMatMul` with 8-bit weight codes as ONNX Runtime
runs them (u8 x s8), with the same weights converted to uint8 (`session.x64quantprecision`, what
klein sets on CPUs without VNNI) and with 7-bit codes (`--reduce-range`); `MatMulNBits` with 4- and
8-bit weights in blocks of 32 at accuracy level 0 (float products) and 4 (int8 products). Random
weights and activations: speed does not depend on the values. Prints the median of --reps runs
after one untimed run, in GOP/s (2 M K N operations per product).
"""

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort

from onnx import TensorProto, helper, numpy_helper

BLOCK = 32


def graph(node, inits, m: int, k: int, n: int) -> bytes:
    g = helper.make_graph(
        [node],
        "product",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [m, n])],
        inits,
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model.SerializeToString()


def kernels(m: int, k: int, n: int, rng) -> list:
    """[(name, graph bytes, session config entries)]."""
    w = rng.standard_normal((k, n)).astype(np.float32)
    fp32 = graph(helper.make_node("MatMul", ["A", "W"], ["Y"]), [numpy_helper.from_array(w, "W")], m, k, n)
    out = [("fp32 MatMul", fp32, {})]
    scale = numpy_helper.from_array(np.full((n,), 0.01, np.float32), "s")
    for name, limit, config in (
        ("int8 u8 x s8", 127, {}),
        ("int8 as uint8", 127, {"session.x64quantprecision": "1"}),
        ("int8 7-bit", 64, {}),
    ):
        codes = numpy_helper.from_array(rng.integers(-limit, limit + 1, (k, n)).astype(np.int8), "Wq")
        node = helper.make_node("DynamicQuantizeMatMul", ["A", "Wq", "s"], ["Y"], domain="com.microsoft")
        out.append((name, graph(node, [codes, scale], m, k, n), config))
    for bits in (4, 8):
        blocks = k // BLOCK
        packed = numpy_helper.from_array(rng.integers(0, 256, (n, blocks, BLOCK * bits // 8)).astype(np.uint8), "B")
        scales = numpy_helper.from_array(np.full((n * blocks,), 0.01, np.float32), "S")
        for level in (0, 4):
            node = helper.make_node(
                "MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft",
                K=k, N=n, bits=bits, block_size=BLOCK, accuracy_level=level,
            )  # fmt: skip
            out.append((f"MatMulNBits {bits}-bit level {level}", graph(node, [packed, scales], m, k, n), {}))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1536,3072,3072", help="M,K,N (default: a 512x512 step's tokens, 4B width)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    m, k, n = (int(v) for v in args.shape.split(","))
    if k % BLOCK:
        p.error(f"--shape: K must be a multiple of {BLOCK} for MatMulNBits")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k)).astype(np.float32)
    print(f"[{m}, {k}] x [{k}, {n}], {args.threads} thread(s), median of {args.reps}")
    for name, model, config in kernels(m, k, n, rng):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = args.threads
        opts.inter_op_num_threads = 1
        for key, value in config.items():
            opts.add_session_config_entry(key, value)
        session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        session.run(None, {"A": a})
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            session.run(None, {"A": a})
            times.append(time.perf_counter() - t)
        median = statistics.median(times)
        print(f"{name:28s} {median * 1e3:9.1f} ms {2 * m * k * n / median / 1e9:8.1f} GOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
