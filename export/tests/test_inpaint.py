"""Inpainting and img2img: the klein CLI (`--image`, `--mask`, `--strength`, `--ref`) against
diffusers' `Flux2KleinInpaintPipeline` on the same inputs.

The inputs exercise every preprocessing step: a source whose sides are not multiples of 16 (diffusers
resizes it, Lanczos, rather than cropping), a mask of another size with soft grey edges (resized,
converted to grey, binarised at half), strengths that skip steps (`get_timesteps`), an extra
reference image, several images per prompt, and a base model with guidance. img2img is klein without
a mask, diffusers with a white one (its pipeline requires a mask).

Tolerance: as every CLI-vs-diffusers test (test_runtime_e2e.py): at most 1 level anywhere, in at
most 1% of pixels, the fp32 noise floor of these sharp random models; the base model's case uses
test_base_model.py's measured floor (guidance scales the fp32 noise).
"""

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinInpaintPipeline
from diffusers.utils import load_image
from klein_binary import KLEIN
from PIL import Image, ImageDraw, ImageFilter

from klein_export.fixtures import synthetic_image

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def inpaint(tiny_checkpoint):
    pipe = Flux2KleinInpaintPipeline.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def soft_mask(width: int, height: int) -> Image.Image:
    """An ellipse and a bar, blurred so that the edges are grey (diffusers' docs blur masks too)."""
    mask = Image.new("L", (width, height), 0)
    draw = ImageDraw.Draw(mask)
    draw.ellipse((width * 0.2, height * 0.15, width * 0.7, height * 0.6), fill=255)
    draw.rectangle((0, height * 0.75, width * 0.5, height * 0.9), fill=200)
    return mask.filter(ImageFilter.GaussianBlur(3)).convert("RGB")


def run_klein(bundle: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    assert KLEIN.is_file(), f"{KLEIN} is missing: build it with `cargo build --release` (scripts/test.sh does)"
    cmd = [str(KLEIN), "generate", "--model", str(bundle), "-o", str(out), "--quiet", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def assert_close(got: np.ndarray, want: np.ndarray, what: str, allowed: float = 0.01) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    diff = np.abs(got.astype(int) - want.astype(int))
    pixels = float((diff > 0).any(axis=-1).mean())
    print(f"{what}: {got.shape[1]}x{got.shape[0]}, max diff {diff.max()}, {100 * pixels:.3f}% of pixels differ")
    assert diff.max() <= 1 and pixels <= allowed, (diff.max(), pixels)


CASES = [
    # id, source size, mask size (None: img2img), strength (None: klein's default), steps, refs, images
    ("inpaint-default-strength", (100, 72), (50, 36), None, 4, [], 1),
    ("inpaint-strength-0.5", (96, 80), (96, 80), 0.5, 4, [], 1),
    ("inpaint-with-reference-2-images", (72, 104), (144, 208), 0.75, 4, [(64, 96)], 2),
    ("img2img-0.6", (88, 64), None, 0.6, 5, [], 1),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_cli_equals_diffusers_inpaint_pipeline(inpaint, tiny_bundle, case, tmp_path):
    name, (sw, sh), mask_size, strength, steps, refs, images = case
    seed = 31 + len(name)
    source = tmp_path / "source.png"
    synthetic_image(sw, sh, "RGB", seed=seed).save(source)
    mask = tmp_path / "mask.png"
    soft_mask(*(mask_size or (sw, sh))).save(mask)
    ref_paths = []
    for i, (w, h) in enumerate(refs):
        ref_paths.append(tmp_path / f"ref{i}.png")
        synthetic_image(w, h, "RGB", seed=seed + 10 + i).save(ref_paths[-1])
    prompt = f"repaint it: {name}"
    with torch.no_grad():
        result = inpaint(
            prompt=prompt,
            image=load_image(str(source)),
            mask_image=load_image(str(mask)) if mask_size else Image.new("RGB", (sw, sh), "white"),
            image_reference=[load_image(str(p)) for p in ref_paths] or None,
            strength=1.0 if strength is None else strength,
            num_inference_steps=steps,
            num_images_per_prompt=images,
            generator=torch.Generator("cpu").manual_seed(seed),
        )
    out = tmp_path / "klein.png"
    args = [prompt, "--image", str(source), "--seed", str(seed), "--steps", str(steps)]
    args += ["--num-images", str(images)]
    if mask_size:
        args += ["--mask", str(mask)]
    if strength is not None:
        args += ["--strength", str(strength)]
    for path in ref_paths:
        args += ["--ref", str(path)]
    run = run_klein(tiny_bundle, out, *args)
    assert run.returncode == 0, run.stderr
    outs = [out] if images == 1 else [out.with_name(f"klein-{i + 1}.png") for i in range(images)]
    for i, (path, want) in enumerate(zip(outs, result.images, strict=True)):
        got = Image.open(path)
        assert got.text["strength"] == ("1" if strength is None else str(strength))
        assert got.text["mask"] == ("yes" if mask_size else "no")
        assert got.text["image"] == str(source)
        assert_close(np.array(got), np.array(want), f"{name} image {i + 1}")


def test_base_model_with_guidance_equals_diffusers(tiny_checkpoint, tiny_bundle, tmp_path):
    """A base checkpoint: 8 steps at strength 0.6 (3 skipped), guidance 4 with its empty negative
    prompt, as diffusers' inpaint pipeline runs it (its own default guidance is 8; klein keeps the
    bundle's, 4, so the test passes it). Tolerance: test_base_model.py's, from diffusers' own floor."""
    from test_base_model import assert_close as assert_close_to_floor
    from test_base_model import make_base, noise_floor

    pipe, bundle = make_base(tiny_checkpoint, tiny_bundle, tmp_path)
    inpaint = Flux2KleinInpaintPipeline(**pipe.components)
    inpaint.set_progress_bar_config(disable=True)
    source, mask = tmp_path / "source.png", tmp_path / "mask.png"
    synthetic_image(80, 64, "RGB", seed=5).save(source)
    soft_mask(80, 64).save(mask)
    kwargs = dict(image=load_image(str(source)), mask_image=load_image(str(mask)), strength=0.6)
    (want,), (floor,) = noise_floor(inpaint, "a base repaint", 12, num_inference_steps=8, guidance_scale=4.0, **kwargs)
    out = tmp_path / "k.png"
    args = ["a base repaint", "--image", str(source), "--mask", str(mask), "--seed", "12", "--strength", "0.6"]
    run = run_klein(bundle, out, *args, "--steps", "8")
    assert run.returncode == 0, run.stderr
    assert Image.open(out).text["guidance"] == "4"
    assert_close_to_floor(np.array(Image.open(out)), want, floor, "base inpaint, 8 steps from 3, guidance 4")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--strength", "0"], "strength 0 must be above 0"),
        (["--strength", "1.5"], "strength 1.5 must be above 0"),
        (["--mask", "{garbage}"], "garbage.png"),
        (["--mask", "{missing}"], "missing.png"),
    ],
    ids=["strength-0", "strength-above-1", "corrupt-mask", "missing-mask"],
)
def test_bad_inpainting_input_is_refused(tiny_bundle, tmp_path, extra, message):
    source = tmp_path / "source.png"
    synthetic_image(100, 72, "RGB", seed=1).save(source)
    (tmp_path / "garbage.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    extra = [a.format(garbage=tmp_path / "garbage.png", missing=tmp_path / "missing.png") for a in extra]
    out = tmp_path / "never.png"
    run = run_klein(tiny_bundle, out, "x", "--image", str(source), *extra)
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert message in run.stderr, run.stderr
    assert "panicked" not in run.stderr
    assert not out.exists()


def test_mask_and_strength_need_a_source(tiny_bundle, tmp_path):
    for args in (["--mask", "m.png"], ["--strength", "0.5"]):
        run = run_klein(tiny_bundle, tmp_path / "never.png", "x", *args)
        assert run.returncode == 2, run.stderr
        assert "--image" in run.stderr, run.stderr


def test_a_size_other_than_the_sources_is_ignored_as_diffusers_does(tiny_bundle, tmp_path):
    """diffusers' inpaint pipeline takes height and width, and makes the source's size anyway: klein
    writes the same file as with no size, and says the size was ignored."""
    source = tmp_path / "source.png"
    synthetic_image(100, 72, "RGB", seed=1).save(source)
    args = ["x", "--image", str(source), "--seed", "5", "--strength", "0.7", "--steps", "2"]
    plain = run_klein(tiny_bundle, tmp_path / "plain.png", *args)
    sized = run_klein(tiny_bundle, tmp_path / "sized.png", *args, "--width", "64", "--height", "48")
    assert plain.returncode == 0 and sized.returncode == 0, (plain.stderr, sized.stderr)
    assert (tmp_path / "sized.png").read_bytes() == (tmp_path / "plain.png").read_bytes()
    assert "width 64 and height 48 are ignored" in sized.stderr and "(96x64), as diffusers does" in sized.stderr
    assert "ignored" not in plain.stderr
