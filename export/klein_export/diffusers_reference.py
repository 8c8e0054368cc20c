"""diffusers' own Flux2KleinPipeline in float32: what `verify`, `ranges` and `fixtures` measure against."""

import numpy as np
import torch


def load_pipeline(checkpoint):
    """The checkpoint's Flux2KleinPipeline in float32, without progress bars."""
    from diffusers import Flux2KleinPipeline

    pipe = Flux2KleinPipeline.from_pretrained(str(checkpoint), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_image(pipe, prompt, seed, width, height, steps, image=None) -> np.ndarray:
    """The pipeline's float image `[H, W, 3]` in [0, 255] (not rounded), guidance 1, CPU noise of `seed`."""
    with torch.no_grad():
        out = pipe(
            image=image,
            prompt=prompt,
            height=height,
            width=width,
            num_inference_steps=steps,
            guidance_scale=1.0,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="np",
        )
    return out.images[0] * 255
