"""The tiny checkpoint is reproducible, and every stage matters to its final image.

PSNR of the image made by diffusers' Flux2KleinPipeline against images made with one thing wrong.
Under 35 dB means the mistake is plainly visible in the image, so end-to-end image tests catch it;
a 1e-6 perturbation of the initial noise must stay above 90 dB (the image depends smoothly on it).
"""

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline
from diffusers.utils import load_image
from PIL import ImageOps
from safetensors.torch import load_file

from klein_export.fixtures import synthetic_image
from klein_export.tiny import build_tiny

PROMPT = "a raccoon astronaut on the moon"
SIZE = 64


def psnr(a, b) -> float:
    mse = np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.fixture(scope="module")
def pipe(tiny_checkpoint):
    p = Flux2KleinPipeline.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def generate(pipe, seed=0, **kwargs):
    kwargs.setdefault("prompt", PROMPT)
    with torch.no_grad():
        out = pipe(
            height=SIZE,
            width=SIZE,
            num_inference_steps=4,
            guidance_scale=1.0,
            generator=torch.Generator("cpu").manual_seed(seed),
            output_type="np",
            **kwargs,
        )
    return out.images[0] * 255  # not rounded: PSNR of the float image, so one rounding flip does not dominate


def embeds_without_template(pipe, prompt):
    ids = pipe.tokenizer(prompt, return_tensors="pt", padding="max_length", truncation=True, max_length=512)
    out = pipe.text_encoder(
        input_ids=ids["input_ids"], attention_mask=ids["attention_mask"], output_hidden_states=True, use_cache=False
    )
    return torch.cat([out.hidden_states[k] for k in (9, 18, 27)], dim=-1)


def test_tiny_checkpoint_is_reproducible(tiny_checkpoint, tmp_path):
    again = build_tiny(tmp_path / "again", seed=0)
    for part in ("text_encoder", "transformer", "vae"):
        a = load_file(str(next((tiny_checkpoint / part).glob("*.safetensors"))))
        b = load_file(str(next((again / part).glob("*.safetensors"))))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), part


def test_every_stage_matters(pipe, tmp_path):
    right = generate(pipe)
    wrong = {
        "hidden layers 8/17/26": generate(pipe, text_encoder_out_layers=(8, 17, 26)),
        "another seed": generate(pipe, seed=1),
    }
    with torch.no_grad():
        wrong["no chat template"] = generate(pipe, prompt=None, prompt_embeds=embeds_without_template(pipe, PROMPT))
    pad = pipe.tokenizer.pad_token
    pipe.tokenizer.pad_token = "<|im_end|>"
    try:
        wrong["pad with <|im_end|>"] = generate(pipe)
    finally:
        pipe.tokenizer.pad_token = pad
    scores = {name: psnr(right, image) for name, image in wrong.items()}
    print("PSNR against the right image (dB):", scores)
    assert all(s < 35 for s in scores.values()), scores

    noise = torch.randn((1, 128, SIZE // 16, SIZE // 16), generator=torch.Generator("cpu").manual_seed(0))
    base = generate(pipe, latents=noise)
    nudged = generate(pipe, latents=noise + 1e-6)
    assert psnr(base, right) == float("inf"), "passing the seed's noise as latents gives the same image"
    print("PSNR with the noise perturbed by 1e-6 (dB):", psnr(base, nudged))
    assert psnr(base, nudged) > 90, psnr(base, nudged)


def test_reference_image_matters(pipe, tmp_path):
    synthetic_image(96, 64, "RGB", seed=5).save(tmp_path / "ref.png")
    ref = load_image(str(tmp_path / "ref.png"))
    right = generate(pipe, image=[ref])
    mirrored = generate(pipe, image=[ImageOps.mirror(ref)])
    assert psnr(right, mirrored) < 35, psnr(right, mirrored)
