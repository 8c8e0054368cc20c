"""`klein generate --mask-crop PADDING` against diffusers' `Flux2KleinInpaintPipeline(padding_mask_crop=)`
on the same files: the crop region (`get_crop_region`), the source and mask cut to it and resized with
`resize_mode="fill"` (Lanczos, plus bicubic edge strips where the region's aspect ratio differs from the
output's), the inpainting at the source's processing size, and the paste-back into the whole source
through the unbinarised mask (Pillow's premultiplied paste and alpha composite).

diffusers 0.42.1's `Flux2ImageProcessor` overrides `_resize_and_crop` with a plain centre crop, so its
paste-back pastes the centre of the generated image instead of the generated image fitted to the region.
klein fits it, as `VaeImageProcessor` (every other diffusers inpaint pipeline) does; the reference here is
diffusers with that paste-back (`VaeImageProcessor().apply_overlay`), every other step diffusers' own.
A test below shows that the two paste-backs differ on these inputs, so the patch is not a no-op.

Tolerance: test_inpaint.py's (at most 1 level, in at most 1% of the output's pixels): the generated region
carries the fp32 noise floor of the tiny models, and the paste-back resamples it.
"""

import numpy as np
import pytest
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils import load_image
from PIL import Image, ImageDraw, ImageFilter
from test_inpaint import assert_close, inpaint, run_klein  # noqa: F401 (`inpaint` is a fixture)

from klein_export.fixtures import synthetic_image

CASES = [
    # id, source size, the mask's white box (left, top, right, bottom), padding, strength
    ("ellipse-padded", (100, 72), (40, 20, 64, 44), 8, None),
    # A wide bar: the region is clamped to the source's width, so its aspect ratio misses the output's
    # (100x66 for 96x64) and `fill` adds a strip.
    ("wide-bar-edge-strip", (100, 72), (0, 30, 100, 40), 0, 0.75),
]


def box_mask(size: tuple[int, int], box: tuple[int, int, int, int]) -> Image.Image:
    """White inside `box`, blurred so that its edges are grey (blended by the paste-back)."""
    mask = Image.new("L", size, 0)
    ImageDraw.Draw(mask).ellipse(box, fill=255)
    return mask.filter(ImageFilter.GaussianBlur(2)).convert("RGB")


def diffusers_image(pipe, prompt, source, mask, padding, strength, seed, overlay):
    pipe.image_processor.apply_overlay = overlay
    try:
        with torch.no_grad():
            return pipe(
                prompt=prompt,
                image=load_image(str(source)),
                mask_image=load_image(str(mask)),
                padding_mask_crop=padding,
                strength=1.0 if strength is None else strength,
                num_inference_steps=4,
                generator=torch.Generator("cpu").manual_seed(seed),
            ).images[0]
    finally:
        del pipe.image_processor.apply_overlay


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cli_equals_diffusers_padding_mask_crop(inpaint, tiny_bundle, case, tmp_path):  # noqa: F811
    name, (sw, sh), box, padding, strength = case
    seed = 50 + len(name)
    source, mask = tmp_path / "source.png", tmp_path / "mask.png"
    synthetic_image(sw, sh, "RGB", seed=seed).save(source)
    box_mask((sw, sh), box).save(mask)
    prompt = f"repaint the region: {name}"
    inputs = (prompt, source, mask, padding, strength, seed)
    want = diffusers_image(inpaint, *inputs, VaeImageProcessor().apply_overlay)
    centre_crop = diffusers_image(inpaint, *inputs, inpaint.image_processor.apply_overlay)

    out = tmp_path / "klein.png"
    args = [prompt, "--image", str(source), "--mask", str(mask), "--mask-crop", str(padding), "--seed", str(seed)]
    if strength is not None:
        args += ["--strength", str(strength)]
    run = run_klein(tiny_bundle, out, *args)
    assert run.returncode == 0, run.stderr
    got = Image.open(out)
    assert got.size == (sw, sh), "the output has the whole source's size"
    assert got.text["mask_crop"] == str(padding)
    assert_close(np.array(got), np.array(want), f"{name}, padding {padding}")
    # The source is kept exactly where the mask is black.
    black = np.array(Image.open(mask).convert("L")) == 0
    assert (np.array(got)[black] == np.array(Image.open(source))[black]).all()
    # diffusers' own centre-crop paste-back gives another image.
    assert np.abs(np.array(centre_crop).astype(int) - np.array(got).astype(int)).max() > 8


@pytest.mark.parametrize(
    "mask_kind, message",
    [("other-size", "the mask is 50x36 and the source image 100x72"), ("black", "black everywhere")],
)
def test_bad_mask_crop_input_is_refused(tiny_bundle, tmp_path, mask_kind, message):
    source, mask = tmp_path / "source.png", tmp_path / "mask.png"
    synthetic_image(100, 72, "RGB", seed=2).save(source)
    if mask_kind == "black":
        Image.new("RGB", (100, 72)).save(mask)
    else:
        box_mask((50, 36), (10, 10, 30, 30)).save(mask)
    out = tmp_path / "never.png"
    run = run_klein(tiny_bundle, out, "x", "--image", str(source), "--mask", str(mask), "--mask-crop", "4")
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert message in run.stderr and str(mask) in run.stderr, run.stderr
    assert "panicked" not in run.stderr
    assert not out.exists()


def test_mask_crop_needs_a_mask(tiny_bundle, tmp_path):
    source = tmp_path / "source.png"
    synthetic_image(64, 64, "RGB", seed=3).save(source)
    run = run_klein(tiny_bundle, tmp_path / "never.png", "x", "--image", str(source), "--mask-crop", "4")
    assert run.returncode == 2, run.stderr
    assert "--mask" in run.stderr, run.stderr
