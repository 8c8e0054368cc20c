"""What a bundle may differ from its reference by: per component (`verify`), and per image (`verify`
and `verify --against`)."""

import numpy as np

from .quantize import DYNAMIC, STATIC

# fp32 tolerance. A case passes when ORT's max abs error against torch fp32 is at most
# max(ABS_TOLERANCE, FLOOR_FACTOR * floor, REL_TOLERANCE * max|torch|), where floor is torch fp32's own
# max abs error against the same module run in float64 on the same inputs. Random-weight models with
# sharp attention amplify rounding: on the tiny checkpoint torch fp32 itself is 7.7e-3 away from
# float64 on embeddings of magnitude 21 (3.6e-4 relative), and ORT's float32 sin/cos of timestep*1000
# differs from torch's by an ulp, which the modulation amplifies to ~5e-5 relative in the velocity.
# A fixed 1e-5 would measure summation order, not the graph; a wrong layer or op gives errors of order 1.
ABS_TOLERANCE = 1e-5
FLOOR_FACTOR = 2.0
REL_TOLERANCE = 1e-4

# Lower precisions. A scheme that rounds at unit error u instead of float32's u32 = 2^-24 gives, to
# first order, errors u/u32 times the float32 ones on the same module and inputs, so its tolerance
# against torch fp32 is the float32 rule with the floor term scaled by u/u32:
#   max(ABS_TOLERANCE, FLOOR_FACTOR * floor * u / u32, REL_TOLERANCE * max|torch|).
# u is half a step relative to the largest value the step is scaled to: float16 2^-11 (weights and
# matmul operands of the float16 islands), symmetric int8 2^-8 and int4 2^-4 (of the block's max |w|).
# The floor measures how much the module amplifies rounding on these very inputs, so the tolerance
# adapts to the model: on the tiny checkpoint, built to make every stage matter, the text encoder
# amplifies float32 rounding ~500-6000x and its int8/int4 tolerances exceed the output's own scale
# (the comparison says nothing there; `line()` says "uninformative"); a better-conditioned model has a
# smaller floor and a tighter tolerance. What then shows that a
# quantized graph computes what it should is the second check: against the torch module with the
# quantizer's own dequantized weights, the graph must agree to the float32 rule (floor: the larger of
# the two modules' fp32-vs-fp64 errors).
U32 = 2.0**-24
UNIT_ERROR = {"fp32": U32, "fp16": 2.0**-11, 8: 2.0**-8, 4: 2.0**-4}

# End to end: PSNR (dB, of the float image in [0, 255]) of the bundle's image against diffusers fp32,
# same prompt, seed and size. fp32: summation order only (tests/test_tiny.py: a 1e-6 change of the
# initial noise stays above 90 dB). fp16: an rms error under 1% of the range. int8/int4: on the tiny
# checkpoint the image moves with the weights by design (a wrong hidden layer costs 32 dB there,
# another seed 14 dB); measured 27-28 dB (int8) and 21 dB (int4), thresholds a few dB below and well
# above an unrelated image. A quantized bundle must also reproduce diffusers run with the same
# dequantized weights to EMULATED_PSNR (float32 differences only).
DYNAMIC_KEY = "int8-dynamic"
PSNR_THRESHOLD = {"fp32": 80.0, "fp16": 40.0, 8: 24.0, 4: 18.0, DYNAMIC_KEY: 20.0}
EMULATED_PSNR = 80.0

# `--method dynamic` also rounds every activation to one of 256 levels per tensor. A float32-sized
# difference before that rounding (summation order) flips a level now and then, and the tiny model
# amplifies each flip (see the floor above), so the graph cannot match torch's emulation to float32
# accuracy. What shows that it computes the quantized model is that it is much closer to the emulation
# than to the float model: component errors against the emulation at most DYNAMIC_EMULATED_SHARE of
# those against torch fp32 (measured on the tiny checkpoint: 0.05 text encoder, 0.11-0.24
# transformer), images at least DYNAMIC_EMULATED_DB closer to the emulation than the quantization moves
# them (measured: 14.5-17.6 dB). Its image threshold (measured 24.0-24.6 dB on the tiny checkpoint,
# where the emulation alone gives 24.3-24.6) is 4 dB under that.
DYNAMIC_EMULATED_SHARE = 0.5
DYNAMIC_EMULATED_DB = 10.0
# FLUX.3 Image Klein at its 16 steps: 16 transformer calls give a level flip more chances, and on the
# tiny FLUX.3 checkpoints one flip moves the image about as far as the whole quantization does.
# Measured on eight prompts and seeds (64x64, a tiny step-distilled checkpoint, int8 dynamic): with no
# flip the runtime's image is 130.8 dB from the emulation (float32 differences only, in 2 of 8); with
# one, 31.9-37.4 dB, where the quantization alone moves it 26.9-30.8 dB; on another checkpoint 34.3 dB
# against 35.1. The flips were found: in the first step of one case, an input element of a joint
# block's query projection lies 1.9e-6 levels from a rounding boundary, and the 5 image tokens whose
# output differs are those downstream of it. So for FLUX.3 the image's distance to the emulation is
# reported, not held to a bar (None). What shows that the graphs compute the quantized model is the
# component check against the emulation (DYNAMIC_EMULATED_SHARE: one call, no accumulated flips), and
# that the runtime runs them with the recipe, its image against the same graphs run from Python
# (export/tests/test_flux3_quantized.py: at most 1 level in at most 1% of pixels).
FLUX3_DYNAMIC_EMULATED_DB = None

# `--method static` (the VAE decoder's convolutions in int8, QDQ) has no torch emulation: its activation
# ranges are calibrated, and every convolution rounds its input to 256 levels. Its component rule is a
# PSNR of the decoder's output (mapped to [0, 255] as the image is) against torch fp32, on the
# random latents of `verify_vae` (outside the calibration set): measured 32.3-32.7 dB on the tiny
# checkpoint, against 34.5 dB for the wide checkpoint's real-size decoder on a 512x512 image; the bar,
# STATIC_COMPONENT_DB, is a few dB under, and far above a wrong or unfused graph (an unrelated image is
# under 15 dB). Its image threshold (a bundle whose only quantized graph is the decoder), measured
# 34.9 dB against diffusers fp32 on the tiny checkpoint, is PSNR_THRESHOLD[STATIC_KEY]. A bundle with a
# static decoder skips the comparison with dequantized diffusers (the decoder's int8 error is not in
# that reference); its text encoder and transformer are still checked against their emulation
# component by component.
STATIC_KEY = "int8-static"
STATIC_COMPONENT_DB = 30.0
PSNR_THRESHOLD[STATIC_KEY] = 28.0


def is_dynamic(quantization) -> bool:
    """Whether a manifest `quantization` is `--method dynamic`'s."""
    return bool(quantization) and quantization.get("method") == DYNAMIC


def is_static(quantization) -> bool:
    """Whether a manifest `quantization` is `--method static`'s (the VAE decoder's int8 convolutions)."""
    return bool(quantization) and quantization.get("method") == STATIC


def _key(quantization):
    """The row of PSNR_THRESHOLD for a manifest `quantization`."""
    if is_static(quantization):
        return STATIC_KEY
    return DYNAMIC_KEY if is_dynamic(quantization) else quantization["bits"]


def scheme_name(precision: str, quantization) -> str:
    if not quantization:
        return precision
    key = _key(quantization)
    return precision + ("+" + key if isinstance(key, str) else f"+int{key}")


def unit_error(precision: str, quantization) -> float:
    """The scheme's u (above). `--method dynamic` rounds both operands of each product to 8 bits, the
    weights (2^-8 of their channel's max) and the activations (uint8 over the tensor's range: half a
    step is 2^-8 of it): 2 x 2^-8."""
    u = UNIT_ERROR[precision]
    if not quantization:
        return u
    return max(u, UNIT_ERROR[quantization["bits"]] * (2 if is_dynamic(quantization) else 1))


def psnr_threshold(spec: dict) -> float:
    """The image PSNR bar of one manifest graph (`graphs.*`): its precision's, or its quantization's if lower."""
    quantization = spec.get("quantization")
    threshold = PSNR_THRESHOLD[spec["precision"]]
    return min(threshold, PSNR_THRESHOLD[_key(quantization)]) if quantization else threshold


def image_bar(graphs: dict) -> tuple:
    """(PSNR threshold, scheme name) of a bundle's image: those of its graph that loses the most."""
    coarsest = min(graphs.values(), key=psnr_threshold)
    return psnr_threshold(coarsest), scheme_name(coarsest["precision"], coarsest.get("quantization"))


def psnr(a, b) -> float:
    mse = np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))
