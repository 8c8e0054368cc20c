"""ONNX Runtime sessions that run int8 weights as exactly as klein's runtime does on this CPU.

On x86-64 CPUs without VNNI (AVX2-only CPUs such as AMD Zen 1-3 and Intel before Ice Lake, and
AVX-512 CPUs without VNNI), ONNX Runtime's u8 x s8 kernels add pairs of products in 16 bits with
saturation (`vpmaddubsw`). With 8-bit weight codes a pair of large activations against large weights
of one sign overflows, and the product comes out wrong. klein's runtime (src/runtime/cpu_features.rs)
then sets `session.x64quantprecision`, which makes ONNX Runtime convert the int8 weights to uint8 at
load (u8 x u8 kernels, exact, somewhat slower). Bundles quantized with `--reduce-range` hold 7-bit
codes, whose pairs fit 16 bits: those keep the faster kernels.

The export tool does the same, so that `verify` and `quantize` report the error the runtime will
have on the CPU at hand. Whether the products saturate is asked of ONNX Runtime itself: one small
product of the largest codes, run once per process (about 1 ms). That answer is the kernel ONNX
Runtime picked, so it also holds under `benches/avx2-host.sh`, which masks the CPU only for the
libraries it patches.
"""

import functools

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

# The session setting that converts int8 weights to uint8 (ONNX Runtime's name).
CONVERT_TO_UINT8 = "session.x64quantprecision"

# The probe: [M, K] uint8 activations of 255 times [K, N] int8 weights of 127. Exact, every output is
# 255 * 127 * K = 2,072,640; where pairs saturate at 32,767 it is 32 * 32,767 = 1,048,544.
_M, _K, _N = 16, 64, 16


def _probe_model() -> bytes:
    a = helper.make_tensor_value_info("a", TensorProto.UINT8, [_M, _K])
    y = helper.make_tensor_value_info("y", TensorProto.INT32, [_M, _N])
    b = numpy_helper.from_array(np.full((_K, _N), 127, np.int8), "b")
    graph = helper.make_graph([helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "int8_probe", [a], [y], [b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8).SerializeToString()


def probe_product(convert: bool) -> np.ndarray:
    """The probe's [M, N] int32 output, with or without the uint8 conversion."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    if convert:
        options.add_session_config_entry(CONVERT_TO_UINT8, "1")
    session = ort.InferenceSession(_probe_model(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"a": np.full((_M, _K), 255, np.uint8)})[0]


@functools.cache
def int8_products_saturate() -> bool:
    """Whether ONNX Runtime's u8 x s8 products of 8-bit codes overflow on this CPU (x86-64 without
    VNNI): the probe's product differs from the exact one."""
    return not (probe_product(convert=False) == 255 * 127 * _K).all()


def converts_int8_weights(reduce_range: bool) -> bool:
    """Whether a session converts its int8 weights to uint8, as the runtime decides it
    (`runtime::converts_int8_weights`): where products saturate, unless the codes are 7-bit."""
    return not reduce_range and int8_products_saturate()


def weights_7bit(spec: dict) -> bool:
    """Whether the graph of the manifest entry `spec` (`graphs.*`) holds 7-bit int8 codes."""
    return bool((spec.get("quantization") or {}).get("reduce_range"))


def session_options(reduce_range: bool = False, threads: int | None = None) -> ort.SessionOptions:
    """CPU session options that run int8 weights as the runtime does here: converted to uint8 where
    8-bit codes would saturate. `reduce_range`: the graph's codes are 7-bit (manifest
    `quantization.reduce_range`). `threads`: intra-op threads (ONNX Runtime's default if None)."""
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    if converts_int8_weights(reduce_range):
        options.add_session_config_entry(CONVERT_TO_UINT8, "1")
    return options


def cpu_session(model, reduce_range: bool = False, threads: int | None = None) -> ort.InferenceSession:
    """A CPU session on `model` (a path or serialized bytes) with `session_options`."""
    options = session_options(reduce_range, threads)
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def cpu_note(graphs: dict) -> str | None:
    """One line on how this CPU runs the int8 codes of a manifest's `graphs` (quantize and verify say
    it, as `klein info` does): None for a bundle without u8 x s8 int8 codes (float, MatMulNBits)."""
    eight, seven = [], []
    for name, spec in graphs.items():
        q = spec.get("quantization") or {}
        if q.get("method") in ("DynamicQuantizeMatMul", "QDQ") and q.get("bits") == 8:
            (seven if q.get("reduce_range") else eight).append(name)
    if not (eight or seven):
        return None
    saturate = int8_products_saturate()
    parts = []
    if eight and saturate:
        parts.append(
            f"{', '.join(eight)} (8-bit codes): this CPU has no VNNI, so ONNX Runtime converts these weights to "
            "uint8 (u8 x u8 kernels: exact, slower), here and in klein; quantizing with "
            "--quantize int8 --method dynamic --reduce-range (7-bit codes) keeps the fast kernels"
        )
    elif eight:
        parts.append(f"{', '.join(eight)} (8-bit codes): u8 x s8 kernels, exact on this CPU")
    if seven:
        parts.append(f"{', '.join(seven)} (7-bit codes): u8 x s8 kernels, exact on every CPU")
    return "int8 kernels: " + "; ".join(parts)
