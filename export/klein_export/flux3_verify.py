"""`klein-export verify` of a FLUX.3 Image Klein bundle: each graph against its torch module in float32
at several shapes (verify.py's `_Checker` and tolerances), and the bundle's image, run by ONNX Runtime
from Python as the runtime runs it, against diffusers' FLUX.3 modular pipeline (flux3_reference.py).
"""

import numpy as np
import torch

from .flux3 import IMAGE_ROPE_SCALE, Flux3Checkpoint
from .flux3_convert import tokenizer_facts
from .flux3_ort_pipeline import _window_feeds, bundle_latents
from .flux3_reference import load_reference, run_reference
from .flux3_wrappers import Flux3TextEncoder, Flux3Transformer
from .manifest import read_manifest
from .ort_pipeline import latent_ids, run_graph, text_ids
from .quantize import emulate_quantization
from .tolerances import FLUX3_DYNAMIC_EMULATED_DB, image_bar, is_dynamic, is_static, psnr
from .verify import ImageResult, _Checker, _key_rows, verify_vae

IMAGE_CASES = (
    {"prompt": "a raccoon astronaut on the moon", "seed": 0, "width": 64, "height": 64},
    {"prompt": "a red fox in the snow, watercolor", "seed": 7, "width": 80, "height": 48},
)


def verify_text_encoder(ckpt, bundle):
    processor = ckpt.load_processor()
    facts = tokenizer_facts(processor)
    layers = ckpt.text_encoder_out_layers
    vl = ckpt.load_text_encoder(num_layers=max(layers))
    checker = _Checker(
        bundle, "text_encoder", Flux3TextEncoder(vl, layers, ckpt.text_encoder_config["num_hidden_layers"])
    )
    for case, prompt in (("short prompt, window 80", "a cat"), ("long prompt, window 160", "a cat on a mat, " * 20)):
        ids, mask = _window_feeds(processor, facts, prompt)
        yield checker.compare(case, (ids, mask), {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})


def _cond_ids(grids):
    rows = [latent_ids(h, w) for h, w in grids]
    for i, r in enumerate(rows):
        r[:, 3] = -(1 + i)
    return torch.cat(rows) if rows else torch.zeros(0, 4, dtype=torch.int64)


class _EagerTransformer(Flux3Transformer):
    """The exported wrapper, run by torch: with no reference tokens, without the reference path
    (torch cannot reshape the empty reference tensors the graph takes)."""

    def forward(self, latents, prompt_embeds, timestep, img_ids, txt_ids, cond_latents, cond_ids, target_timestep=None):
        args = (latents, prompt_embeds, timestep, img_ids, txt_ids, cond_latents, cond_ids, target_timestep)
        return self.velocity(*args, with_cond=cond_latents.shape[1] > 0)


def verify_transformer(ckpt, bundle):
    model = ckpt.load_transformer()
    cfg = model.config
    checker = _Checker(bundle, "transformer", _EagerTransformer(model, IMAGE_ROPE_SCALE).eval())
    g = torch.Generator().manual_seed(1)
    # A case with references first: a quantized graph's emulation (verify._Checker) is built on the
    # first case's call, which must reach every linear.
    for b, (h, w), seq, grids in ((2, (3, 5), 160, [(2, 3)]), (1, (4, 4), 80, []), (1, (2, 2), 80, [(3, 2), (2, 2)])):
        refs = sum(gh * gw for gh, gw in grids)
        args = [
            torch.randn(b, h * w, cfg.in_channels, generator=g),
            torch.randn(b, seq, cfg.joint_attention_dim, generator=g),
            torch.full((b,), 0.8),
            latent_ids(h, w),
            text_ids(seq),
            torch.randn(b, refs, cfg.cond_in_channels, generator=g),
            _cond_ids(grids),
        ]
        if cfg.flow_map:
            args.append(torch.full((b,), 0.6))
        names = ["latents", "prompt_embeds", "timestep", "img_ids", "txt_ids", "cond_latents", "cond_ids"]
        names += ["target_timestep"] if cfg.flow_map else []
        feeds = {name: arg.numpy() for name, arg in zip(names, args, strict=True)}
        yield checker.compare(f"batch {b}, {h}x{w} tokens, {len(grids)} refs, seq {seq}", tuple(args), feeds)


def verify(checkpoint, bundle):
    ckpt = Flux3Checkpoint(checkpoint)
    yield from verify_text_encoder(ckpt, bundle)
    yield from verify_transformer(ckpt, bundle)
    yield from verify_vae(ckpt, bundle)


def bundle_image(bundle, prompt, seed, width, height, steps):
    """The bundle's text-to-image result `[H, W, 3]` in [0, 255] (not rounded): flux3_ort_pipeline's
    latents, decoded by the bundle's VAE decoder."""
    latents = bundle_latents(bundle, prompt, seed, width, height, steps)
    image = run_graph(bundle, read_manifest(bundle)["graphs"]["vae_decoder"], {"latents": latents})
    return np.clip(image[0].transpose(1, 2, 0) * 0.5 + 0.5, 0, 1) * 255


def _dequantize(pipe, graphs):
    """Gives `pipe`'s text encoder and transformer the dequantized weights of their quantized float32
    graphs (verify._dequantize_pipeline for FLUX.3): the wrappers share the pipeline's modules, so
    their weights change in place, and only the linears the graph quantized change (the per-image
    modulations, computed on `[B, D]` in the wrapper, stay float as in the graph)."""
    g = torch.Generator().manual_seed(0)
    layers = pipe.klein_out_layers
    text_encoder = Flux3TextEncoder(pipe.text_encoder, layers, pipe.text_encoder.config.text_config.num_hidden_layers)
    ids = torch.randint(0, pipe.text_encoder.config.text_config.vocab_size, (1, 8), generator=g)
    cfg = pipe.transformer.config
    grids = [(1, 2)]  # one reference: the call reaches every linear
    transformer_args = (
        torch.randn(1, 4, cfg.in_channels, generator=g),
        torch.randn(1, 3, cfg.joint_attention_dim, generator=g),
        torch.tensor([0.5]),
        latent_ids(2, 2),
        text_ids(3),
        torch.randn(1, 2, cfg.cond_in_channels, generator=g),
        _cond_ids(grids),
        *((torch.tensor([0.25]),) if cfg.flow_map else ()),
    )
    examples = {
        "text_encoder": (text_encoder, (ids, torch.ones_like(ids))),
        "transformer": (_EagerTransformer(pipe.transformer, IMAGE_ROPE_SCALE), transformer_args),
    }
    for component, (module, args) in examples.items():
        spec = graphs[component]
        if spec.get("quantization") and spec["precision"] == "fp32" and not is_static(spec["quantization"]):
            emulate_quantization(module, spec["quantization"], args, _key_rows(spec))


def verify_images(checkpoint, bundle, cases=IMAGE_CASES):
    """One ImageResult per case: the bundle's image against diffusers fp32 and, for a bundle with
    quantized float32 graphs (and no static decoder), against diffusers with the same dequantized
    weights, as verify.verify_images."""
    manifest = read_manifest(bundle)
    graphs, steps = manifest["graphs"], manifest["model"]["default_steps"]
    threshold, label = image_bar(graphs)
    pipe = load_reference(checkpoint)

    def images(pipe):
        return [
            run_reference(pipe, c["prompt"], c["seed"], c["width"], c["height"], steps=steps)[0] * 255 for c in cases
        ]

    references, emulated = images(pipe), [None] * len(cases)
    quantized = [s.get("quantization") for s in graphs.values() if s["precision"] == "fp32"]
    if any(quantized) and not any(is_static(q) for q in quantized):
        _dequantize(pipe, graphs)
        emulated = images(pipe)
    del pipe
    dynamic = any(is_dynamic(s.get("quantization")) for s in graphs.values())
    for case, want, dequantized in zip(cases, references, emulated, strict=True):
        got = bundle_image(bundle, case["prompt"], case["seed"], case["width"], case["height"], steps)
        name = f"{case['width']}x{case['height']} seed {case['seed']}, {steps} steps"
        result = ImageResult(
            name, label, psnr(got, want), threshold, dynamic=dynamic, dynamic_margin=FLUX3_DYNAMIC_EMULATED_DB
        )
        if dequantized is not None:
            result.emulated_psnr, result.scheme_psnr = psnr(got, dequantized), psnr(dequantized, want)
        yield result
