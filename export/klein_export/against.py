"""`klein-export verify --bundle B --against REF`: a bundle's graphs against another bundle of the
same checkpoint (its fp32 export), in ONNX Runtime, without the checkpoint or torch models.

For checkpoints too large to hold torch fp32, its float64 copy and a session at once (the 4B widths:
`verify` against torch needs ~3x the text encoder in memory), this measures what a lower precision
or a quantization costs: each component on the same realistic inputs (the reference's own prompt
embeddings, the first step's noise and timestep, a decodable latent grid), one session at a time, and
the final image of the same prompt and seed (`ort_pipeline.bundle_image` for both bundles).
"""

from dataclasses import dataclass

import numpy as np
import torch

from .errors import BundleError
from .manifest import MANIFEST, architecture_differences, read_manifest
from .ort_pipeline import bundle_image, latent_ids, no_reference_feeds, prompt_feeds, run_graph, text_ids
from .tolerances import image_bar, psnr

PROMPT = "a red fox in the snow, golden hour, photograph"


@dataclass
class Difference:
    component: str
    case: str
    max_abs: float
    max_rel: float  # max abs / max |reference|
    rms_rel: float  # rms error / rms reference

    def line(self) -> str:
        return (
            f"{self.component:13s} {self.case:34s} max_abs {self.max_abs:.2e}  "
            f"max_rel {self.max_rel:.2e}  rms_rel {self.rms_rel:.2e}"
        )


def _difference(component, case, got, want) -> Difference:
    got, want = got.astype(np.float64), want.astype(np.float64)
    err = np.abs(got - want)
    scale = max(float(np.abs(want).max()), 1e-30)
    rms = max(float(np.sqrt(np.mean(want**2))), 1e-30)
    max_abs, rms_err = float(err.max()), float(np.sqrt(np.mean(err**2)))
    return Difference(component, case, max_abs, max_abs / scale, rms_err / rms)


def check_same_model(bundle, reference):
    """BundleError unless the two bundles' manifests describe the same architecture (widths, depths,
    text encoder out layers, VAE): one's inputs would not fit the other's graphs."""
    ours, theirs = read_manifest(bundle), read_manifest(reference)
    differences = architecture_differences(ours, theirs)
    kv = [bool(m["model"].get("kv_cache")) for m in (ours, theirs)]
    if kv[0] != kv[1]:
        differences.append(f"model.kv_cache {kv[0]} vs {kv[1]}")
    # The weights, beyond the architecture: a fine-tune's transformer, LoRAs merged at export.
    for key in ("transformer_file", "loras"):
        if ours["model"].get(key) != theirs["model"].get(key):
            differences.append(f"model.{key} {ours['model'].get(key)} vs {theirs['model'].get(key)}")
    lower = [
        f"{name} {graph.get('precision')}" + (" quantized" if graph.get("quantization") else "")
        for name, graph in theirs["graphs"].items()
        if graph.get("precision") != "fp32" or graph.get("quantization")
    ]
    if lower:
        raise BundleError(
            f"{reference}: not an fp32 bundle ({', '.join(lower)}): the reference is the checkpoint's fp32 "
            f"export, and {bundle} the one measured against it (the other way round?)"
        )
    if differences:
        raise BundleError(
            f"{reference}: not a reference bundle of the model of {bundle} ({bundle}/{MANIFEST} vs "
            f"{reference}/{MANIFEST}: {'; '.join(differences)}): compare bundles of the same checkpoint"
        )


def component_differences(bundle, reference, width=512, height=512, seed=0):
    """Yields one Difference per component: `bundle` against `reference` on the same inputs."""
    check_same_model(bundle, reference)
    graphs, manifest = read_manifest(bundle)["graphs"], read_manifest(reference)
    multiple, channels = manifest["latents"]["pixel_multiple"], manifest["latents"]["channels"]

    def both(component, feeds):
        """(bundle output, reference output), one session in memory at a time."""
        want = run_graph(reference, manifest["graphs"][component], feeds)
        return run_graph(bundle, graphs[component], feeds), want

    ids = prompt_feeds(reference, manifest["tokenizer"], PROMPT)
    got, embeds = both("text_encoder", ids)
    yield _difference("text_encoder", f"1 prompt, L {ids['input_ids'].shape[1]}", got, embeds)

    h, w = height // multiple, width // multiple
    g = torch.Generator("cpu").manual_seed(seed)
    noise = torch.randn((1, h * w, channels), generator=g).numpy()
    feeds = {
        "latents": noise,
        "prompt_embeds": embeds,  # the reference's: each graph is measured on its own
        "timestep": np.ones((1,), np.float32),
        "img_ids": latent_ids(h, w).numpy(),
        "txt_ids": text_ids(embeds.shape[1]).numpy(),
        **no_reference_feeds(manifest, 1),
    }
    yield _difference("transformer", f"{width}x{height}, first step", *both("transformer", feeds))

    latents = torch.randn((1, channels, h, w), generator=g).numpy()
    yield _difference("vae_decoder", f"{w}x{h} latents", *both("vae_decoder", {"latents": latents}))
    image = (torch.rand((1, 3, height, width), generator=g) * 2 - 1).numpy()
    yield _difference("vae_encoder", f"{width}x{height} image", *both("vae_encoder", {"image": image}))


@dataclass
class ImageDifference:
    case: str
    scheme: str
    psnr: float
    threshold: float

    @property
    def ok(self) -> bool:
        return self.psnr >= self.threshold

    def line(self) -> str:
        return (
            f"image         {self.case:34s} {self.scheme:9s} PSNR {self.psnr:6.2f} dB against the reference bundle "
            f"(min {self.threshold:.0f})  {'ok' if self.ok else 'FAIL'}"
        )


def image_difference(bundle, reference, width=512, height=512, seed=0, steps=None) -> ImageDifference:
    """The final image of `bundle` against `reference`'s, same prompt, seed and size, with verify's
    PSNR bar for `bundle` (tolerances.image_bar)."""
    check_same_model(bundle, reference)
    threshold, scheme = image_bar(read_manifest(bundle)["graphs"])
    got = bundle_image(bundle, PROMPT, seed, width, height, steps)
    want = bundle_image(reference, PROMPT, seed, width, height, steps)
    return ImageDifference(f"{width}x{height} seed {seed}", scheme, psnr(got, want), threshold)
