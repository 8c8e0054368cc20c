"""`klein-export verify` of a FLUX.3 Image Klein bundle: each graph against its torch module in float32
at several shapes (verify.py's `_Checker` and tolerances), and the bundle's image, run by ONNX Runtime
from Python as the runtime runs it, against diffusers' FLUX.3 modular pipeline (flux3_reference.py).
"""

from pathlib import Path

import numpy as np
import torch

from .flux3 import IMAGE_ROPE_SCALE, Flux3Checkpoint
from .flux3_convert import tokenizer_facts
from .flux3_reference import load_reference, run_reference
from .flux3_wrappers import Flux3TextEncoder, Flux3Transformer
from .manifest import read_manifest
from .ort_pipeline import latent_ids, run_graph, session, text_ids
from .tolerances import image_bar, psnr
from .verify import ImageResult, _Checker, verify_vae

IMAGE_CASES = (
    {"prompt": "a raccoon astronaut on the moon", "seed": 0, "width": 64, "height": 64},
    {"prompt": "a red fox in the snow, watercolor", "seed": 7, "width": 80, "height": 48},
)


def _window_feeds(processor, facts, prompt):
    text = facts["prompt_prefix"] + prompt + facts["prompt_suffix"]
    ids = processor.tokenizer(text, truncation=True, max_length=facts["max_sequence_length"])["input_ids"]
    multiple = facts["pad_multiple"]
    window = min(-(-len(ids) // multiple) * multiple, facts["max_sequence_length"])
    enc = processor.tokenizer(text, padding="max_length", truncation=True, max_length=window, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


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
    """The exported wrapper, run by torch: with no reference tokens diffusers' own text-to-image call
    (torch cannot reshape the empty reference tensors the graph takes)."""

    def forward(self, latents, prompt_embeds, timestep, img_ids, txt_ids, cond_latents, cond_ids, target_timestep=None):
        if cond_latents.shape[1]:
            return super().forward(
                latents, prompt_embeds, timestep, img_ids, txt_ids, cond_latents, cond_ids, target_timestep
            )
        return self.transformer(
            hidden_states=latents,
            encoder_hidden_states=prompt_embeds,
            timestep=timestep,
            img_ids=img_ids.to(torch.float32) * self.scale,
            txt_ids=txt_ids.to(torch.float32),
            target_timestep=target_timestep,
            return_dict=False,
        )[0]


def verify_transformer(ckpt, bundle):
    model = ckpt.load_transformer()
    cfg = model.config
    checker = _Checker(bundle, "transformer", _EagerTransformer(model, IMAGE_ROPE_SCALE).eval())
    g = torch.Generator().manual_seed(1)
    for b, (h, w), seq, grids in ((1, (4, 4), 80, []), (2, (3, 5), 160, [(2, 3)]), (1, (2, 2), 80, [(3, 2), (2, 2)])):
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
    """The bundle's text-to-image result `[H, W, 3]` in [0, 255] (not rounded), its graphs run by ONNX Runtime with the
    runtime's recipe: the window, the noise of torch's generator, the shifted schedule, and the
    flow map's target timestep."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import PreTrainedTokenizerFast

    manifest = read_manifest(bundle)
    graphs, facts = manifest["graphs"], manifest["tokenizer"]

    class _Processor:
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_file=str(Path(bundle) / facts["file"]), pad_token=facts["pad_token"], padding_side="right"
        )

    def encode(text):
        ids, mask = _window_feeds(_Processor, facts, text)
        return run_graph(bundle, graphs["text_encoder"], {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})

    embeds = encode(prompt)
    # A base model runs classifier-free guidance with the empty negative prompt (diffusers' default).
    guidance = manifest["model"]["default_guidance"]
    negative = encode("") if not manifest["model"]["is_distilled"] and guidance > 1 else None
    m = manifest["latents"]["pixel_multiple"]
    h, w = height // m, width // m
    noise = torch.randn(1, manifest["latents"]["channels"], h, w, generator=torch.Generator("cpu").manual_seed(seed))
    latents = noise.flatten(2).transpose(1, 2).numpy()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=manifest["scheduler"]["shift"])
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps))
    timesteps = scheduler.timesteps
    flow_map = manifest["transformer"].get("flow_map", False)
    transformer = session(bundle, graphs["transformer"])

    def velocity(text, i, t):
        feeds = {
            "latents": latents,
            "prompt_embeds": text,
            "timestep": np.array([t / 1000], dtype=np.float32),
            "img_ids": latent_ids(h, w).numpy(),
            "txt_ids": text_ids(text.shape[1]).numpy(),
            "cond_latents": np.zeros((1, 0, latents.shape[2]), np.float32),
            "cond_ids": np.zeros((0, 4), np.int64),
        }
        if flow_map:
            nxt = timesteps[i + 1] / 1000 if i + 1 < len(timesteps) else torch.tensor(0.0)
            feeds["target_timestep"] = np.array([nxt], dtype=np.float32)
        return transformer.run(None, feeds)[0]

    for i, t in enumerate(timesteps):
        v = velocity(embeds, i, t)
        if negative is not None:
            uncond = velocity(negative, i, t)
            v = uncond + np.float32(guidance) * (v - uncond)
        latents = scheduler.step(torch.from_numpy(v), t, torch.from_numpy(latents), return_dict=False)[0].numpy()
    grid = latents.reshape(1, h, w, -1).transpose(0, 3, 1, 2)
    image = run_graph(bundle, graphs["vae_decoder"], {"latents": np.ascontiguousarray(grid)})
    return np.clip(image[0].transpose(1, 2, 0) * 0.5 + 0.5, 0, 1) * 255


def verify_images(checkpoint, bundle, cases=IMAGE_CASES):
    manifest = read_manifest(bundle)
    steps = manifest["model"]["default_steps"]
    threshold, label = image_bar(manifest["graphs"])
    pipe = load_reference(checkpoint)
    for case in cases:
        want = run_reference(pipe, case["prompt"], case["seed"], case["width"], case["height"], steps=steps)[0] * 255
        got = bundle_image(bundle, case["prompt"], case["seed"], case["width"], case["height"], steps)
        name = f"{case['width']}x{case['height']} seed {case['seed']}, {steps} steps"
        yield ImageResult(name, label, psnr(got, want), threshold)
