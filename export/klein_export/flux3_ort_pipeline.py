"""A FLUX.3 bundle's text-to-image run by ONNX Runtime from Python, with the runtime's recipe: what
`verify` compares with diffusers, and what `quantize --method static` calibrates the decoder on
(ort_pipeline.bundle_latents dispatches here for FLUX.3 bundles)."""

from pathlib import Path

import numpy as np
import torch

from .manifest import read_manifest
from .ort_pipeline import latent_ids, run_graph, session, text_ids


def _window_feeds(processor, facts, prompt):
    text = facts["prompt_prefix"] + prompt + facts["prompt_suffix"]
    ids = processor.tokenizer(text, truncation=True, max_length=facts["max_sequence_length"])["input_ids"]
    multiple = facts["pad_multiple"]
    window = min(-(-len(ids) // multiple) * multiple, facts["max_sequence_length"])
    enc = processor.tokenizer(text, padding="max_length", truncation=True, max_length=window, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def bundle_latents(bundle, prompt, seed, width, height, steps=None):
    """The VAE decoder's input `[1, C, h, w]` of the bundle's text-to-image result, its graphs run by
    ONNX Runtime with the runtime's recipe: the window, the noise of torch's generator, the shifted schedule, and the
    flow map's target timestep."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import PreTrainedTokenizerFast

    manifest = read_manifest(bundle)
    graphs, facts = manifest["graphs"], manifest["tokenizer"]
    steps = steps or manifest["model"]["default_steps"]

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
    return np.ascontiguousarray(latents.reshape(1, h, w, -1).transpose(0, 3, 1, 2))
