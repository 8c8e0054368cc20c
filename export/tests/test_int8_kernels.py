"""int8_kernels.py: the probe tells CPUs whose int8 products saturate, and sessions made with its
options are exact on every CPU. scripts/test.sh runs this file twice: as the host is, and under
benches/avx2-host.sh (an AVX2-only CPU, without VNNI), where the probe must see saturation: that
shows the mask reached ONNX Runtime, so the int8 tests run beside it test the AVX2 kernels."""

import os
import platform
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from klein_export.int8_kernels import (
    CONVERT_TO_UINT8,
    converts_int8_weights,
    cpu_session,
    int8_products_saturate,
    probe_product,
    session_options,
)

pytestmark = pytest.mark.int8_kernels


def _host_has_vnni() -> bool:
    """What the kernel reports of this CPU (Linux): VNNI in either form."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return "avx_vnni" in flags or "avx512_vnni" in flags


def test_the_probe_sees_the_cpu_onnx_runtime_sees():
    """Under avx2-host.sh (KLEIN_BENCH_ISA_MASK=avx2) products saturate; elsewhere on x86-64 Linux
    exactly when the CPU has no VNNI; never on other architectures."""
    if os.environ.get("KLEIN_BENCH_ISA_MASK") == "avx2":
        want = True
    elif platform.machine() in ("x86_64", "AMD64") and Path("/proc/cpuinfo").exists():
        want = not _host_has_vnni()
    else:
        want = False
    assert int8_products_saturate() is want


def test_converted_products_are_exact():
    """255 x 127 summed over K = 64: 2,072,640 in every output with the conversion, on any CPU; without
    it, exact where the probe says so and clamped pair sums (1,048,544) where it does not."""
    assert (probe_product(convert=True) == 255 * 127 * 64).all()
    plain = probe_product(convert=False)
    assert (plain == (32 * 32767 if int8_products_saturate() else 255 * 127 * 64)).all()


def _config(options, key):
    """A session config entry's value, None where it is not set (ONNX Runtime raises)."""
    try:
        return options.get_session_config_entry(key)
    except RuntimeError:
        return None


def test_seven_bit_codes_are_never_converted():
    """7-bit codes (`--reduce-range`) keep the u8 x s8 kernels everywhere; 8-bit codes are converted
    exactly where products saturate, as the runtime's `converts_int8_weights` decides."""
    assert converts_int8_weights(reduce_range=True) is False
    assert converts_int8_weights(reduce_range=False) is int8_products_saturate()
    assert _config(session_options(reduce_range=True), CONVERT_TO_UINT8) is None
    want = "1" if int8_products_saturate() else None
    assert _config(session_options(reduce_range=False), CONVERT_TO_UINT8) == want


def test_a_session_of_8_bit_codes_is_exact_here():
    """A DynamicQuantizeMatMul of the worst case (activations quantized to 255, weights of 127 with
    scale 1/127, so each product is 1 x 1 after scaling) through `cpu_session`: K = 256 in every
    output to float32 rounding (its activation scale 1/255 is not exact: 2e-4 relative). Saturated
    pair sums would give about half."""
    k, n = 256, 8
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, n])
    weights = [
        numpy_helper.from_array(np.full((k, n), 127, np.int8), "b"),
        numpy_helper.from_array(np.full(n, 1 / 127, np.float32), "s"),
    ]
    node = helper.make_node("DynamicQuantizeMatMul", ["a", "b", "s"], ["y"], domain="com.microsoft")
    graph = helper.make_graph([node], "worst_case", [a], [y], weights)
    opsets = [helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8).SerializeToString()
    x = np.ones((4, k), np.float32)
    x[0, 0] = 0  # the range [0, 1]: every other activation's code is 255
    (got,) = cpu_session(model).run(None, {"a": x})
    np.testing.assert_allclose(got[1:], k, rtol=2e-4)
