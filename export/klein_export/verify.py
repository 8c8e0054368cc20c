"""`klein-export verify`: torch against ONNX Runtime, component by component, at several shapes, and
the final image of the bundle against diffusers'.

Each component is run by the torch wrapper in float32 (the same modules the exporter traced) and by
ONNX Runtime on the bundle's graph with identical inputs; the report gives max abs and relative error
per case, whatever the graph's precision and quantization (manifest `graphs.*`). A quantized graph of
float32 precision is also compared with the same torch module whose weights went through the same
quantizer and back (`quantize.emulate_quantization`), which it must match to float32 accuracy. End to
end, the bundle's image (`ort_pipeline.bundle_image`) is compared with diffusers' `Flux2KleinPipeline`
in float32. The tolerances are in tolerances.py.
"""

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .checkpoint import Checkpoint
from .diffusers_reference import reference_images
from .errors import BundleError
from .kv_cache import KvTransformer, kv_layers
from .manifest import check_bundle_of, check_files, read_manifest
from .ort_pipeline import bundle_image, latent_ids, session, text_ids
from .quantize import emulate_quantization
from .tokenizer_facts import tokenizer_facts
from .tolerances import (
    ABS_TOLERANCE,
    DYNAMIC_EMULATED_DB,
    DYNAMIC_EMULATED_SHARE,
    EMULATED_PSNR,
    FLOOR_FACTOR,
    REL_TOLERANCE,
    STATIC_COMPONENT_DB,
    U32,
    image_bar,
    is_dynamic,
    is_static,
    psnr,
    scheme_name,
    unit_error,
)
from .wrappers import TextEncoder, Transformer, VaeDecoder, VaeEncoder

IMAGE_CASES = (
    {"prompt": "a raccoon astronaut on the moon", "seed": 0, "width": 64, "height": 64},
    {"prompt": "a red fox in the snow, watercolor", "seed": 7, "width": 80, "height": 48},
)


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
    dynamic: bool = False  # activations quantized too (tolerances.DYNAMIC_EMULATED_SHARE)
    psnr: float = None  # `--method static` graphs: PSNR against torch fp32 (tolerances.STATIC_COMPONENT_DB)

    @property
    def tolerance(self) -> float:
        return max(ABS_TOLERANCE, FLOOR_FACTOR * self.floor * self.unit / U32, REL_TOLERANCE * self.scale)

    @property
    def emulated_tolerance(self) -> float:
        floats = max(ABS_TOLERANCE, FLOOR_FACTOR * max(self.floor, self.emulated_floor), REL_TOLERANCE * self.scale)
        return max(floats, DYNAMIC_EMULATED_SHARE * self.max_abs) if self.dynamic else floats

    @property
    def ok(self) -> bool:
        if self.psnr is not None:
            return self.psnr >= STATIC_COMPONENT_DB
        emulated_ok = self.emulated_abs is None or self.emulated_abs <= self.emulated_tolerance
        return self.max_abs <= self.tolerance and emulated_ok

    def line(self) -> str:
        status = "ok" if self.ok else "FAIL"
        if self.psnr is not None:
            return (
                f"{self.component:13s} {self.case:38s} {self.scheme:9s} max_abs {self.max_abs:.2e}  "
                f"PSNR vs torch fp32 {self.psnr:5.1f} dB (min {STATIC_COMPONENT_DB:.0f})  {status}"
            )
        vacuous = ", uninformative" if self.tolerance >= self.scale else ""
        emulated = (
            f"  dequantized-torch {self.emulated_abs:.2e} tol {self.emulated_tolerance:.2e}"
            if self.emulated_abs is not None
            else ""
        )
        return (
            f"{self.component:13s} {self.case:38s} {self.scheme:9s} max_abs {self.max_abs:.2e}  "
            f"rel {self.max_rel:.2e}  torch-fp32-vs-fp64 {self.floor:.2e}  tol {self.tolerance:.2e} "
            f"({self.tolerance / self.scale:.1e} rel{vacuous}){emulated}  {status}"
        )


@dataclass
class ImageResult:
    case: str
    scheme: str
    psnr: float  # bundle vs diffusers fp32
    threshold: float
    emulated_psnr: float = None  # bundle vs diffusers with the dequantized weights
    scheme_psnr: float = None  # diffusers with the dequantized weights vs diffusers fp32
    dynamic: bool = False  # activations quantized too (tolerances.DYNAMIC_EMULATED_DB)
    dynamic_margin: float = DYNAMIC_EMULATED_DB  # FLUX.3's is FLUX3_DYNAMIC_EMULATED_DB

    @property
    def emulated_threshold(self) -> float | None:
        """None: reported, not held to a bar (FLUX.3's --method dynamic, tolerances.FLUX3_DYNAMIC_EMULATED_DB)."""
        if not self.dynamic:
            return EMULATED_PSNR
        return None if self.dynamic_margin is None else self.scheme_psnr + self.dynamic_margin

    @property
    def ok(self) -> bool:
        if self.emulated_psnr is None:  # no dequantized reference (fp32, fp16, a static decoder)
            return self.psnr >= self.threshold
        bar = self.emulated_threshold
        emulated_ok = bar is None or self.emulated_psnr >= bar
        return self.psnr >= self.threshold and emulated_ok

    def line(self) -> str:
        extra = ""
        if self.emulated_psnr is not None:
            bar = "reported" if self.emulated_threshold is None else f"min {self.emulated_threshold:.0f}"
            extra = (
                f"  vs dequantized diffusers {self.emulated_psnr:6.1f} dB ({bar})  "
                f"quantization alone {self.scheme_psnr:5.1f} dB"
            )
        return (
            f"{'image':13s} {self.case:38s} {self.scheme:9s} PSNR vs diffusers fp32 {self.psnr:6.1f} dB "
            f"(min {self.threshold:.0f}){extra}  {'ok' if self.ok else 'FAIL'}"
        )


def _key_rows(spec) -> bool:
    """Whether the graph `spec` (a manifest entry) projects its keys and values from the real tokens'
    rows only (real_keys.py), which `emulate_quantization` must follow."""
    return bool(spec.get("fusions", {}).get("key_projections_trimmed"))


def _run_torch(module, module64, args):
    """The module's fp32 output and its max abs error against its float64 copy `module64`."""
    with torch.no_grad():
        want = module(*args)
        exact = module64(*[a.double() if a.is_floating_point() else a for a in args])
    return want, float((want.double() - exact).abs().max())


class _Checker:
    """Compares one graph's outputs with its torch module, as the manifest says the graph was made."""

    def __init__(self, bundle: Path, component: str, module):
        spec = read_manifest(bundle)["graphs"][component]
        self.component, self.module = component, module
        self.precision, self.quantization = spec["precision"], spec.get("quantization")
        self.key_rows = _key_rows(spec)
        self.session = session(bundle, spec)
        self.module64 = copy.deepcopy(module).double()
        self.emulated = None  # (module, its float64 copy) with the dequantized weights

    def _emulated(self, args):
        """The module with the quantizer's dequantized weights (quantized float32 graphs only)."""
        if self.quantization is None or self.precision != "fp32" or is_static(self.quantization):
            return None
        if self.emulated is None:
            emulated = copy.deepcopy(self.module)
            replaced = emulate_quantization(emulated, self.quantization, args, self.key_rows)
            # One node per weight, but for products cut into column ranges (bundles since quantized_weights).
            weights = self.quantization.get("quantized_weights", self.quantization["quantized_nodes"])
            if replaced != weights:
                raise RuntimeError(
                    f"{self.component}: {replaced} linear weights quantized in torch, the graph has "
                    f"{weights} quantized weights ({self.quantization['method']})"
                )
            self.emulated = (emulated, copy.deepcopy(emulated).double())
        return self.emulated

    def compare(self, case, args, feeds) -> CaseResult:
        got = self.session.run(None, feeds)[0]
        want, floor = _run_torch(self.module, self.module64, args)
        want = want.numpy()
        scheme = scheme_name(self.precision, self.quantization)
        if want.shape != got.shape:
            mismatch = f"{case} shape {got.shape} != {want.shape}"
            return CaseResult(self.component, mismatch, float("inf"), float("inf"), 0.0, 0.0, scheme)
        diff = float(np.abs(want.astype(np.float64) - got.astype(np.float64)).max())
        scale = max(float(np.abs(want).max()), 1e-30)
        unit = unit_error(self.precision, self.quantization)
        result = CaseResult(self.component, case, diff, diff / scale, floor, scale, scheme, unit)
        result.dynamic = is_dynamic(self.quantization)
        if is_static(self.quantization):  # decoder output, [-1, 1] -> the image's [0, 255]
            result.psnr = psnr(got * 127.5, want * 127.5)
        emulated = self._emulated(args)
        if emulated is not None:
            want_q, result.emulated_floor = _run_torch(*emulated, args)
            result.emulated_abs = float(np.abs(want_q.numpy().astype(np.float64) - got.astype(np.float64)).max())
        return result


def _tokenize(tokenizer, facts, prompts):
    texts = [facts["prompt_prefix"] + p + facts["prompt_suffix"] for p in prompts]
    enc = tokenizer(
        texts, padding="max_length", truncation=True, max_length=facts["max_sequence_length"], return_tensors="pt"
    )
    return enc["input_ids"], enc["attention_mask"]


def verify_text_encoder(ckpt, bundle):
    tokenizer = ckpt.load_tokenizer()
    facts = tokenizer_facts(tokenizer)
    layers = ckpt.text_encoder_out_layers
    module = TextEncoder(ckpt.load_text_encoder(num_layers=max(layers)), layers).eval()
    check = _Checker(bundle, "text_encoder", module)
    cases = {
        "batch 1, L 512": _tokenize(tokenizer, facts, ["a raccoon astronaut on the moon"]),
        "batch 2, L 512": _tokenize(tokenizer, facts, ["", "an 80s ski photo, grainy film, 日本語"]),
    }
    ids, mask = _tokenize(tokenizer, facts, ["short"])
    cases["batch 1, L 77"] = (ids[:, :77], mask[:, :77])
    for case, (ids, mask) in cases.items():
        yield check.compare(case, (ids, mask), {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})


class _Velocity(torch.nn.Module):
    """The KV transformer's first output (the velocity; the K/V it extracts feed the next case)."""

    def __init__(self, kv_transformer):
        super().__init__()
        self.inner = kv_transformer

    def forward(self, *args):
        return self.inner(*args)[0]


def verify_transformer(ckpt, bundle):
    model = ckpt.load_transformer()
    cfg = model.config
    if ckpt.is_kv:
        yield from _verify_kv_transformer(ckpt, bundle, KvTransformer(model).eval())
        return
    module = Transformer(model).eval()
    check = _Checker(bundle, "transformer", module)
    g = torch.Generator().manual_seed(1)
    cases = {
        "batch 1, 4x4, L 512": (1, (4, 4), [], 512),
        "batch 2, 3x5, L 64": (2, (3, 5), [], 64),
        "batch 1, 4x4 + refs 2x3, 5x4, L 512": (1, (4, 4), [(2, 3), (5, 4)], 512),
        "batch 2, 2x6 + ref 3x3, L 32": (2, (2, 6), [(3, 3)], 32),
    }
    for case, (b, (h, w), refs, seq) in cases.items():
        ids = [latent_ids(h, w)] + [latent_ids(rh, rw, 10 + 10 * i) for i, (rh, rw) in enumerate(refs)]
        img_ids = torch.cat(ids, dim=0)
        latents = torch.randn(b, img_ids.shape[0], cfg.in_channels, generator=g)
        embeds = torch.randn(b, seq, cfg.joint_attention_dim, generator=g)
        timestep = torch.rand(b, generator=g)
        feeds = {
            "latents": latents,
            "prompt_embeds": embeds,
            "timestep": timestep,
            "img_ids": img_ids,
            "txt_ids": text_ids(seq),
        }
        yield check.compare(case, tuple(feeds.values()), {k: v.numpy() for k, v in feeds.items()})


def _verify_kv_transformer(ckpt, bundle, module):
    """A KV checkpoint's transformer in its three modes: a first step that extracts the references'
    K/V, a later step on cached K/V (random ones: any cache must give the module's output), and a
    step without references."""
    cfg = module.transformer.config
    check = _Checker(bundle, "transformer", _Velocity(module))
    g = torch.Generator().manual_seed(1)
    layers, inner = kv_layers(cfg), cfg.num_attention_heads * cfg.attention_head_dim
    cases = {
        "extract: batch 1, 4x4 + refs 2x3, 5x4, L 512": (1, (4, 4), [(2, 3), (5, 4)], 0, 512),
        "cached: batch 2, 3x5, 26 cached tokens, L 64": (2, (3, 5), [], 26, 64),
        "no references: batch 1, 4x4, L 32": (1, (4, 4), [], 0, 32),
    }
    for case, (b, (h, w), refs, cached, seq) in cases.items():
        ref_ids = [latent_ids(rh, rw, 10 + 10 * i) for i, (rh, rw) in enumerate(refs)]
        ref_ids = torch.cat(ref_ids, dim=0) if ref_ids else torch.zeros(0, 4, dtype=torch.int64)
        feeds = {
            "latents": torch.randn(b, h * w, cfg.in_channels, generator=g),
            "prompt_embeds": torch.randn(b, seq, cfg.joint_attention_dim, generator=g),
            "timestep": torch.rand(b, generator=g),
            "img_ids": latent_ids(h, w),
            "txt_ids": text_ids(seq),
            "ref_latents": torch.randn(b, ref_ids.shape[0], cfg.in_channels, generator=g),
            "ref_ids": ref_ids,
            "cached_kv": torch.randn(layers, 2, b, cached, inner, generator=g),
        }
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


def check_verifiable(bundle):
    """BundleError unless `bundle` is one verify can run: with dynamic shapes (it runs each graph at
    several batch sizes and shapes), and its files as exported (another graph in a graph's place
    would fail inside ONNX Runtime)."""
    manifest = read_manifest(bundle)
    if manifest.get("static_shapes"):
        raise BundleError(
            f"{bundle}: a static-shape bundle (batch 1, its size buckets only), which verify cannot run: it "
            "verifies bundles with dynamic shapes. Its graphs are those of the same convert without "
            "--static-shapes with fixed input shapes: verify that bundle"
        )
    check_files(bundle, manifest)


def verify(checkpoint, bundle, components=("text_encoder", "transformer", "vae"), transformer=None):
    """Yields one CaseResult per component and shape; `transformer`: the single file the bundle's
    transformer was exported from (convert --transformer)."""
    ckpt = Checkpoint(checkpoint, transformer)
    check_bundle_of(read_manifest(bundle), bundle, ckpt)
    steps = {"text_encoder": verify_text_encoder, "transformer": verify_transformer, "vae": verify_vae}
    for component in components:
        yield from steps[component](ckpt, bundle)


# ---------------------------------------------------------------------------------------------------
# End to end


def _dequantize_pipeline(pipe, graphs, out_layers):
    """Gives `pipe`'s text encoder and transformer (those it has) the dequantized weights of their
    quantized graphs."""
    g = torch.Generator().manual_seed(0)
    examples = {}
    # The wrappers share the pipeline's modules, so their weights change in place.
    if pipe.text_encoder is not None:
        ids = torch.randint(0, pipe.text_encoder.config.vocab_size, (1, 8), generator=g)
        examples["text_encoder"] = (TextEncoder(pipe.text_encoder, out_layers), (ids, torch.ones_like(ids)))
    if pipe.transformer is not None:
        cfg = pipe.transformer.config
        examples["transformer"] = (
            Transformer(pipe.transformer),
            (
                torch.randn(1, 4, cfg.in_channels, generator=g),
                torch.randn(1, 3, cfg.joint_attention_dim, generator=g),
                torch.tensor([0.5]),
                latent_ids(2, 2),
                text_ids(3),
            ),
        )
    for component, (module, args) in examples.items():
        spec = graphs[component]
        if spec.get("quantization") and spec["precision"] == "fp32":
            emulate_quantization(module, spec["quantization"], args, _key_rows(spec))


def image_cases(size=None):
    """IMAGE_CASES, or with `size`: the first case's prompt and seed at `size` x `size`."""
    if size is None:
        return IMAGE_CASES
    return ({**IMAGE_CASES[0], "width": size, "height": size},)


def verify_images(checkpoint, bundle, cases=IMAGE_CASES, transformer=None):
    """Yields one ImageResult per case: the bundle's image against diffusers fp32 (and, for a bundle
    with quantized float32 graphs, against diffusers with the same dequantized weights). The
    diffusers images are made first (`reference_images`: never the text encoder and the transformer
    in memory at once) and their pipelines freed before the bundle runs. `transformer`: as `verify`'s."""
    ckpt = Checkpoint(checkpoint, transformer)
    manifest = read_manifest(bundle)
    check_bundle_of(manifest, bundle, ckpt)
    graphs, steps = manifest["graphs"], manifest["model"]["default_steps"]
    threshold, label = image_bar(graphs)
    references = reference_images(checkpoint, cases, steps, transformer=transformer)
    emulated = [None] * len(cases)
    emulable = any(s.get("quantization") and s["precision"] == "fp32" for s in graphs.values())
    if emulable and not any(is_static(s.get("quantization")) for s in graphs.values()):
        layers = ckpt.text_encoder_out_layers
        emulated = reference_images(
            checkpoint, cases, steps, lambda pipe: _dequantize_pipeline(pipe, graphs, layers), transformer
        )
    dynamic = any(is_dynamic(s.get("quantization")) for s in graphs.values())
    for case, reference, dequantized in zip(cases, references, emulated, strict=True):
        name = f"{case['width']}x{case['height']} seed {case['seed']}, {steps} steps"
        got = bundle_image(bundle, case["prompt"], case["seed"], case["width"], case["height"], steps)
        result = ImageResult(name, label, psnr(got, reference), threshold, dynamic=dynamic)
        if dequantized is not None:
            result.emulated_psnr, result.scheme_psnr = psnr(got, dequantized), psnr(dequantized, reference)
        yield result
