"""`klein-export verify`: torch against ONNX Runtime, component by component, at several shapes, and
the final image of the bundle against diffusers'.

Each component is run by the torch wrapper in float32 (the same modules the exporter traced) and by
ONNX Runtime on the bundle's graph with identical inputs; the report gives max abs and relative error
per case, whatever the graph's precision and quantization (manifest `graphs.*`). A quantized graph of
float32 precision is also compared with the same torch module whose weights went through the same
quantizer and back (`quantize.emulate_quantization`), which it must match to float32 accuracy. End to
end, `bundle_image` runs the bundle with ONNX Runtime (numpy pipeline: transformers tokenizer, torch
noise, diffusers' scheduler) and compares the image with diffusers' `Flux2KleinPipeline` in float32.
"""

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from .checkpoint import Checkpoint
from .manifest import HIDDEN_LAYERS
from .quantize import QuantizationConfig, emulate_quantization
from .tokenizer_facts import tokenizer_facts
from .wrappers import TextEncoder, Transformer, VaeDecoder, VaeEncoder

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
PSNR_THRESHOLD = {"fp32": 80.0, "fp16": 40.0, 8: 24.0, 4: 18.0}
EMULATED_PSNR = 80.0
IMAGE_CASES = (
    {"prompt": "a raccoon astronaut on the moon", "seed": 0, "width": 64, "height": 64},
    {"prompt": "a red fox in the snow, watercolor", "seed": 7, "width": 80, "height": 48},
)


def scheme_name(precision: str, quantization) -> str:
    return precision + (f"+int{quantization['bits']}" if quantization else "")


def unit_error(precision: str, quantization) -> float:
    u = UNIT_ERROR[precision]
    return max(u, UNIT_ERROR[quantization["bits"]]) if quantization else u


@dataclass
class CaseResult:
    component: str
    case: str
    max_abs: float
    max_rel: float
    floor: float
    scale: float
    scheme: str = "fp32"
    unit: float = U32
    emulated_abs: float = None  # against torch with the dequantized weights (quantized fp32 graphs)
    emulated_floor: float = 0.0

    @property
    def tolerance(self) -> float:
        return max(ABS_TOLERANCE, FLOOR_FACTOR * self.floor * self.unit / U32, REL_TOLERANCE * self.scale)

    @property
    def emulated_tolerance(self) -> float:
        return max(ABS_TOLERANCE, FLOOR_FACTOR * max(self.floor, self.emulated_floor), REL_TOLERANCE * self.scale)

    @property
    def ok(self) -> bool:
        emulated_ok = self.emulated_abs is None or self.emulated_abs <= self.emulated_tolerance
        return self.max_abs <= self.tolerance and emulated_ok

    def line(self) -> str:
        status = "ok" if self.ok else "FAIL"
        vacuous = ", uninformative" if self.tolerance >= self.scale else ""
        emulated = (
            f"  dequantized-torch {self.emulated_abs:.2e} tol {self.emulated_tolerance:.2e}" if self.emulated_abs is not None else ""
        )
        return (
            f"{self.component:13s} {self.case:38s} {self.scheme:9s} max_abs {self.max_abs:.2e}  rel {self.max_rel:.2e}  "
            f"torch-fp32-vs-fp64 {self.floor:.2e}  tol {self.tolerance:.2e} ({self.tolerance / self.scale:.1e} rel{vacuous}){emulated}  {status}"
        )


@dataclass
class ImageResult:
    case: str
    scheme: str
    psnr: float  # bundle vs diffusers fp32
    threshold: float
    emulated_psnr: float = None  # bundle vs diffusers with the dequantized weights
    scheme_psnr: float = None  # diffusers with the dequantized weights vs diffusers fp32

    @property
    def ok(self) -> bool:
        return self.psnr >= self.threshold and (self.emulated_psnr is None or self.emulated_psnr >= EMULATED_PSNR)

    def line(self) -> str:
        extra = ""
        if self.emulated_psnr is not None:
            extra = f"  vs dequantized diffusers {self.emulated_psnr:6.1f} dB (min {EMULATED_PSNR:.0f})  quantization alone {self.scheme_psnr:5.1f} dB"
        return (
            f"{'image':13s} {self.case:38s} {self.scheme:9s} PSNR vs diffusers fp32 {self.psnr:6.1f} dB (min {self.threshold:.0f}){extra}  "
            f"{'ok' if self.ok else 'FAIL'}"
        )


def _session(bundle: Path, file: str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    return ort.InferenceSession(str(bundle / file), opts, providers=["CPUExecutionProvider"])


def _run_torch(module, module64, args):
    """The module's fp32 output and its max abs error against its float64 copy `module64`."""
    with torch.no_grad():
        want = module(*args)
        exact = module64(*[a.double() if a.is_floating_point() else a for a in args])
    return want, float((want.double() - exact).abs().max())


class _Checker:
    """Compares one graph's outputs with its torch module, as the manifest says the graph was made."""

    def __init__(self, bundle: Path, component: str, module):
        spec = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))["graphs"][component]
        self.component, self.module = component, module
        self.precision, self.quantization = spec["precision"], spec.get("quantization")
        self.session = _session(bundle, spec["file"])
        self.module64 = copy.deepcopy(module).double()
        self.emulated = None  # (module, its float64 copy) with the dequantized weights

    def _emulated(self, args):
        """The module with the quantizer's dequantized weights (quantized float32 graphs only)."""
        if self.quantization is None or self.precision != "fp32":
            return None
        if self.emulated is None:
            emulated = copy.deepcopy(self.module)
            replaced = emulate_quantization(emulated, _config(self.quantization), args)
            if replaced != self.quantization["quantized_nodes"]:
                raise RuntimeError(
                    f"{self.component}: {replaced} linear weights quantized in torch, the graph has "
                    f"{self.quantization['quantized_nodes']} MatMulNBits nodes"
                )
            self.emulated = (emulated, copy.deepcopy(emulated).double())
        return self.emulated

    def compare(self, case, args, feeds) -> CaseResult:
        got = self.session.run(None, feeds)[0]
        want, floor = _run_torch(self.module, self.module64, args)
        want = want.numpy()
        scheme = scheme_name(self.precision, self.quantization)
        if want.shape != got.shape:
            return CaseResult(self.component, f"{case} shape {got.shape} != {want.shape}", float("inf"), float("inf"), 0.0, 0.0, scheme)
        diff = float(np.abs(want.astype(np.float64) - got.astype(np.float64)).max())
        scale = max(float(np.abs(want).max()), 1e-30)
        result = CaseResult(self.component, case, diff, diff / scale, floor, scale, scheme, unit_error(self.precision, self.quantization))
        emulated = self._emulated(args)
        if emulated is not None:
            want_q, result.emulated_floor = _run_torch(*emulated, args)
            result.emulated_abs = float(np.abs(want_q.numpy().astype(np.float64) - got.astype(np.float64)).max())
        return result


def _config(quantization: dict) -> QuantizationConfig:
    return QuantizationConfig(
        bits=quantization["bits"],
        block_size=quantization["block_size"],
        symmetric=quantization["symmetric"],
        accuracy_level=quantization.get("accuracy_level") or 0,
    )


def _tokenize(tokenizer, facts, prompts):
    texts = [facts["prompt_prefix"] + p + facts["prompt_suffix"] for p in prompts]
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=facts["max_sequence_length"], return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def verify_text_encoder(ckpt, bundle):
    tokenizer = ckpt.load_tokenizer()
    facts = tokenizer_facts(tokenizer)
    module = TextEncoder(ckpt.load_text_encoder(num_layers=max(HIDDEN_LAYERS)), HIDDEN_LAYERS).eval()
    check = _Checker(bundle, "text_encoder", module)
    cases = {
        "batch 1, L 512": _tokenize(tokenizer, facts, ["a raccoon astronaut on the moon"]),
        "batch 2, L 512": _tokenize(tokenizer, facts, ["", "an 80s ski photo, grainy film, 日本語"]),
    }
    ids, mask = _tokenize(tokenizer, facts, ["short"])
    cases["batch 1, L 77"] = (ids[:, :77], mask[:, :77])
    for case, (ids, mask) in cases.items():
        yield check.compare(case, (ids, mask), {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})


def _latent_ids(h, w, t=0):
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([torch.full_like(ys, t).flatten(), ys.flatten(), xs.flatten(), torch.zeros_like(ys).flatten()], dim=1)


def _text_ids(seq):
    return torch.stack([torch.zeros(seq, dtype=torch.int64)] * 3 + [torch.arange(seq)], dim=1)


def verify_transformer(ckpt, bundle):
    model = ckpt.load_transformer()
    module = Transformer(model).eval()
    cfg = model.config
    check = _Checker(bundle, "transformer", module)
    g = torch.Generator().manual_seed(1)
    cases = {
        "batch 1, 4x4, L 512": (1, (4, 4), [], 512),
        "batch 2, 3x5, L 64": (2, (3, 5), [], 64),
        "batch 1, 4x4 + refs 2x3, 5x4, L 512": (1, (4, 4), [(2, 3), (5, 4)], 512),
        "batch 2, 2x6 + ref 3x3, L 32": (2, (2, 6), [(3, 3)], 32),
    }
    for case, (b, (h, w), refs, seq) in cases.items():
        ids = [_latent_ids(h, w)] + [_latent_ids(rh, rw, 10 + 10 * i) for i, (rh, rw) in enumerate(refs)]
        img_ids = torch.cat(ids, dim=0)
        latents = torch.randn(b, img_ids.shape[0], cfg.in_channels, generator=g)
        embeds = torch.randn(b, seq, cfg.joint_attention_dim, generator=g)
        timestep = torch.rand(b, generator=g)
        feeds = {"latents": latents, "prompt_embeds": embeds, "timestep": timestep, "img_ids": img_ids, "txt_ids": _text_ids(seq)}
        yield check.compare(case, tuple(feeds.values()), {k: v.numpy() for k, v in feeds.items()})


def verify_vae(ckpt, bundle):
    vae = ckpt.load_vae()
    enc = _Checker(bundle, "vae_encoder", VaeEncoder(vae).eval())
    dec = _Checker(bundle, "vae_decoder", VaeDecoder(vae).eval())
    g = torch.Generator().manual_seed(2)
    for b, h, w in ((1, 64, 64), (2, 48, 80), (1, 96, 32)):
        image = torch.rand(b, 3, h, w, generator=g) * 2 - 1
        yield enc.compare(f"batch {b}, {h}x{w}", (image,), {"image": image.numpy()})
    latent_ch = vae.config.latent_channels * 4
    for b, h, w in ((1, 4, 4), (2, 3, 5), (1, 6, 2)):
        latents = torch.randn(b, latent_ch, h, w, generator=g)
        yield dec.compare(f"batch {b}, {h}x{w} latents", (latents,), {"latents": latents.numpy()})


def verify(checkpoint, bundle, components=("text_encoder", "transformer", "vae")):
    """Yields one CaseResult per component and shape."""
    ckpt = Checkpoint(checkpoint)
    bundle = Path(bundle)
    steps = {"text_encoder": verify_text_encoder, "transformer": verify_transformer, "vae": verify_vae}
    for component in components:
        yield from steps[component](ckpt, bundle)


# ---------------------------------------------------------------------------------------------------
# End to end


def psnr(a, b) -> float:
    mse = np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def bundle_image(bundle, prompt, seed, width, height, steps=None) -> np.ndarray:
    """Text to image with the bundle's graphs in ONNX Runtime: float image `[H, W, 3]` in [0, 255]
    (not rounded). Tokenised with transformers from the bundle's tokenizer.json and manifest, noise
    from a CPU torch generator, sigmas from diffusers' scheduler, as Flux2KleinPipeline does."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
    from transformers import PreTrainedTokenizerFast

    bundle = Path(bundle)
    manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    graphs, tok = manifest["graphs"], manifest["tokenizer"]
    steps = steps or manifest["model"]["default_steps"]

    # 1. prompt -> embeddings [1, L, joint_dim]
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(bundle / tok["file"]), pad_token=tok["pad_token"], padding_side=tok["padding_side"])
    enc = tokenizer(
        [tok["prompt_prefix"] + prompt + tok["prompt_suffix"]],
        padding="max_length",
        truncation=True,
        max_length=tok["max_sequence_length"],
        add_special_tokens=tok["add_special_tokens"],
        return_tensors="np",
    )
    feeds = {"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": enc["attention_mask"].astype(np.int64)}
    embeds = _session(bundle, graphs["text_encoder"]["file"]).run(None, feeds)[0]
    txt_ids = _text_ids(embeds.shape[1]).numpy()

    # 2. noise [1, C, h, w] -> packed [1, h*w, C]
    multiple, channels = manifest["latents"]["pixel_multiple"], manifest["latents"]["channels"]
    h, w = height // multiple, width // multiple
    noise = torch.randn((1, channels, h, w), generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32).numpy()
    x = noise.reshape(1, channels, h * w).transpose(0, 2, 1).copy()
    img_ids = _latent_ids(h, w).numpy()

    # 3. schedule
    sch = manifest["scheduler"]
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=sch["num_train_timesteps"],
        shift=sch["shift"],
        use_dynamic_shifting=sch["use_dynamic_shifting"],
        time_shift_type=sch["time_shift_type"],
    )
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=compute_empirical_mu(h * w, steps))
    sigmas = scheduler.sigmas.numpy().astype(np.float32)
    timesteps = scheduler.timesteps.numpy().astype(np.float32)

    # 4. denoise: x += (sigma_{i+1} - sigma_i) * v, float32
    transformer = _session(bundle, graphs["transformer"]["file"])
    for i in range(steps):
        feeds = {"latents": x, "prompt_embeds": embeds, "timestep": np.full((1,), timesteps[i] / np.float32(1000), np.float32)}
        v = transformer.run(None, {**feeds, "img_ids": img_ids, "txt_ids": txt_ids})[0][:, : h * w]
        x = (x + (sigmas[i + 1] - sigmas[i]) * v).astype(np.float32)

    # 5. decode: [1, h*w, C] -> [1, C, h, w] -> image [1, 3, H, W]
    latents = x.transpose(0, 2, 1).reshape(1, channels, h, w)
    image = _session(bundle, graphs["vae_decoder"]["file"]).run(None, {"latents": latents})[0]
    return np.clip(image[0].transpose(1, 2, 0) / 2 + 0.5, 0, 1) * 255


def diffusers_image(pipe, prompt, seed, width, height, steps) -> np.ndarray:
    """Flux2KleinPipeline's float image `[H, W, 3]` in [0, 255] (not rounded)."""
    with torch.no_grad():
        out = pipe(
            prompt=prompt,
            height=height,
            width=width,
            num_inference_steps=steps,
            guidance_scale=1.0,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="np",
        )
    return out.images[0] * 255


def _dequantize_pipeline(pipe, graphs):
    """Gives `pipe`'s text encoder and transformer the dequantized weights of their quantized graphs."""
    cfg = pipe.transformer.config
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, pipe.text_encoder.config.vocab_size, (1, 8), generator=g)
    examples = {
        # The wrappers share the pipeline's modules, so their weights change in place.
        "text_encoder": (TextEncoder(pipe.text_encoder, HIDDEN_LAYERS), (ids, torch.ones_like(ids))),
        "transformer": (
            Transformer(pipe.transformer),
            (torch.randn(1, 4, cfg.in_channels, generator=g), torch.randn(1, 3, cfg.joint_attention_dim, generator=g),
             torch.tensor([0.5]), _latent_ids(2, 2), _text_ids(3)),
        ),
    }
    for component, (module, args) in examples.items():
        spec = graphs[component]
        if spec.get("quantization") and spec["precision"] == "fp32":
            emulate_quantization(module, _config(spec["quantization"]), args)


def _psnr_threshold(spec) -> float:
    quantization = spec.get("quantization")
    threshold = PSNR_THRESHOLD[spec["precision"]]
    return min(threshold, PSNR_THRESHOLD[quantization["bits"]]) if quantization else threshold


def verify_images(checkpoint, bundle, cases=IMAGE_CASES):
    """Yields one ImageResult per case: the bundle's image against diffusers fp32 (and, for a bundle
    with quantized float32 graphs, against diffusers with the same dequantized weights)."""
    from diffusers import Flux2KleinPipeline

    bundle = Path(bundle)
    manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
    graphs, steps = manifest["graphs"], manifest["model"]["default_steps"]
    coarsest = min(graphs.values(), key=_psnr_threshold)  # the graph that loses the most sets the bar
    threshold, label = _psnr_threshold(coarsest), scheme_name(coarsest["precision"], coarsest.get("quantization"))
    pipe = Flux2KleinPipeline.from_pretrained(str(checkpoint), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    images = [(c, diffusers_image(pipe, c["prompt"], c["seed"], c["width"], c["height"], steps)) for c in cases]
    dequantized = any(s.get("quantization") and s["precision"] == "fp32" for s in graphs.values())
    if dequantized:
        _dequantize_pipeline(pipe, graphs)
    for case, reference in images:
        name = f"{case['width']}x{case['height']} seed {case['seed']}, {steps} steps"
        got = bundle_image(bundle, case["prompt"], case["seed"], case["width"], case["height"], steps)
        result = ImageResult(name, label, psnr(got, reference), threshold)
        if dequantized:
            emulated = diffusers_image(pipe, case["prompt"], case["seed"], case["width"], case["height"], steps)
            result.emulated_psnr, result.scheme_psnr = psnr(got, emulated), psnr(emulated, reference)
        yield result
