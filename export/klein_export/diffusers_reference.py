"""diffusers' own Flux2KleinPipeline in float32: what `verify`, `ranges` and `fixtures` measure against.

Every call passes the checkpoint's `text_encoder_out_layers` (checkpoint.py): diffusers does not read
them from model_index.json, and its default (9, 18, 27) is wrong for a checkpoint that records others.
"""

import gc
from pathlib import Path

import numpy as np
import torch

from .checkpoint import DEFAULT_OUT_LAYERS, Checkpoint, CheckpointError, check_complete


def load_pipeline(checkpoint, **components):
    """The checkpoint's Flux2KleinPipeline (Flux2KleinKVPipeline for a KV checkpoint) in float32,
    without progress bars; `components` are passed to `from_pretrained` (`transformer=None` leaves
    the transformer out; the KV pipeline needs one, and its prompt encoding is the plain one's)."""
    from diffusers import Flux2KleinKVPipeline, Flux2KleinPipeline

    kv = Checkpoint(checkpoint).is_kv and components.get("transformer", "") is not None
    cls = Flux2KleinKVPipeline if kv else Flux2KleinPipeline
    try:
        pipe = cls.from_pretrained(str(checkpoint), dtype=torch.float32, **components)
    except Exception as e:  # the libraries raise many types for a bad file; name the checkpoint
        raise CheckpointError(f"{checkpoint}: diffusers could not load it ({type(e).__name__}: {e})") from e
    for name, component in pipe.components.items():
        check_complete(Path(checkpoint) / name, component)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_image(
    pipe, prompt, seed, width, height, steps, image=None, out_layers=DEFAULT_OUT_LAYERS, prompt_embeds=None
) -> np.ndarray:
    """The pipeline's float image `[H, W, 3]` in [0, 255] (not rounded), guidance 1 (the KV pipeline
    has none), CPU noise of `seed`; from `prompt_embeds` (`encode_prompt`'s) instead of `prompt` when
    given."""
    from diffusers import Flux2KleinKVPipeline

    guidance = {} if isinstance(pipe, Flux2KleinKVPipeline) else {"guidance_scale": 1.0}
    with torch.no_grad():
        out = pipe(
            image=image,
            prompt=None if prompt_embeds is not None else prompt,
            prompt_embeds=prompt_embeds,
            height=height,
            width=width,
            num_inference_steps=steps,
            **guidance,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="np",
            text_encoder_out_layers=tuple(out_layers),
        )
    return out.images[0] * 255


def reference_images(checkpoint, cases, steps, prepare=None, transformer=None) -> list:
    """diffusers' image (`diffusers_image`) of each case (`prompt`, `seed`, `width`, `height`), in two
    stages so that the text encoder and the transformer are never in memory together (at the 9B
    widths each is 5 GB in float32): every prompt's embeddings with a pipeline without transformer
    and VAE, then the images from those embeddings with a pipeline without text encoder. The
    pipeline takes given embeddings as they are: the images equal one pipeline's bit for bit.
    `prepare(pipe)`, if given, is applied to each stage's pipeline before it runs. `transformer`: a
    single file with the transformer's weights (convert --transformer), used instead of the
    checkpoint's."""
    layers = Checkpoint(checkpoint).text_encoder_out_layers
    pipe = load_pipeline(checkpoint, transformer=None, vae=None)
    if prepare is not None:
        prepare(pipe)
    with torch.no_grad():
        embeds = [pipe.encode_prompt(case["prompt"], text_encoder_out_layers=layers)[0] for case in cases]
    del pipe
    gc.collect()
    given = {} if transformer is None else {"transformer": Checkpoint(checkpoint, transformer).load_transformer()}
    pipe = load_pipeline(checkpoint, text_encoder=None, tokenizer=None, **given)
    del given
    if prepare is not None:
        prepare(pipe)
    images = [
        diffusers_image(pipe, None, c["seed"], c["width"], c["height"], steps, out_layers=layers, prompt_embeds=e)
        for c, e in zip(cases, embeds, strict=True)
    ]
    del pipe
    gc.collect()
    return images
