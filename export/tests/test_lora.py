"""LoRAs in klein against diffusers: every layout `Flux2LoraLoaderMixin` reads, one LoRA and two
stacked, negative and fractional scales, merged by klein at load time and by the exporter.

diffusers loads each file with `load_lora_weights` and `set_adapters(names, scales)`; klein gets the
same files with `--lora FILE:SCALE`. Tolerance as the base parity tests (test_runtime_e2e.py): at
most 1 level anywhere and in at most 1% of pixels. Each LoRA is strong enough that the image moves
(PSNR against the image without it under 30 dB), so that equality means the LoRA was applied.

Needs the release binary (`cargo test --release` builds it; scripts/test.sh runs that first).
"""

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline
from PIL import Image

from klein_export.convert import convert
from klein_export.lora_merge import LoraSpec
from lora_files import (
    linear_shapes,
    write_bfl,
    write_kohya,
    write_lokr_bfl,
    write_lokr_lycoris,
    write_peft,
)

REPO = Path(__file__).resolve().parents[2]
KLEIN = REPO / "target" / "release" / "klein"
PROMPT, SEED, SIZE, STEPS = "a lighthouse at dusk", 11, 64, 3


def psnr(a, b):
    mse = float(((a.astype(float) - b.astype(float)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


@pytest.fixture(scope="module")
def loras(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    pipe = Flux2KleinPipeline.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    shapes = linear_shapes(pipe.transformer)
    return {
        "peft": write_peft(pipe.transformer, root / "peft.safetensors"),
        "bfl": write_bfl(shapes, root / "bfl.safetensors"),
        "peft-prefix": write_bfl(shapes, root / "peft_prefix.safetensors", seed=5, prefix="base_model.model."),
        "kohya": write_kohya(shapes, root / "kohya.safetensors"),
        "lokr-bfl": write_lokr_bfl(shapes, root / "lokr_bfl.safetensors"),
        "lokr-lycoris": write_lokr_lycoris(shapes, root / "lokr_lycoris.safetensors"),
    }


def diffusers_image(checkpoint, adapters):
    """diffusers' image with `adapters` [(file, scale)] (a fresh pipeline: LoKr may fuse its QKV)."""
    pipe = Flux2KleinPipeline.from_pretrained(str(checkpoint), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    names = []
    for i, (path, _) in enumerate(adapters):
        pipe.load_lora_weights(str(path), adapter_name=f"a{i}")
        names.append(f"a{i}")
    if names:
        pipe.set_adapters(names, [scale for _, scale in adapters])
    with torch.no_grad():
        image = pipe(
            prompt=PROMPT,
            width=SIZE,
            height=SIZE,
            num_inference_steps=STEPS,
            guidance_scale=1.0,
            generator=torch.Generator("cpu").manual_seed(SEED),
        ).images[0]
    return np.array(image)


def klein_image(bundle, adapters, out):
    assert KLEIN.is_file(), f"{KLEIN} is missing: build it with `cargo build --release` (scripts/test.sh does)"
    cmd = [str(KLEIN), "generate", PROMPT, "--model", str(bundle), "--seed", str(SEED), "--steps", str(STEPS)]
    cmd += ["--width", str(SIZE), "--height", str(SIZE), "-o", str(out), "--quiet"]
    for path, scale in adapters:
        cmd += ["--lora", f"{path}:{scale}"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return np.array(Image.open(out))


@pytest.fixture(scope="module")
def base_image(tiny_checkpoint):
    return diffusers_image(tiny_checkpoint, [])


CASES = {
    "peft": [("peft", 1.0)],
    "bfl-fractional": [("bfl", 0.7)],
    "peft-prefix": [("peft-prefix", 1.0)],
    "kohya-fp16": [("kohya", 1.0)],
    "lokr-bfl-fused-qkv": [("lokr-bfl", 1.0)],
    "lokr-lycoris-above-one": [("lokr-lycoris", 1.5)],
    "stacked-negative": [("peft", 0.6), ("kohya", -0.8)],
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_lora_equals_diffusers(case, loras, tiny_checkpoint, tiny_bundle, base_image, tmp_path):
    adapters = [(loras[name], scale) for name, scale in CASES[case]]
    want = diffusers_image(tiny_checkpoint, adapters)
    got = klein_image(tiny_bundle, adapters, tmp_path / "klein.png")
    moved = psnr(want, base_image)
    diff = np.abs(got.astype(int) - want.astype(int))
    pixels = float((diff > 0).any(axis=-1).mean())
    print(f"{case}: vs diffusers max {diff.max()}, {100 * pixels:.2f}% of pixels; LoRA moved the image to {moved:.1f} dB")
    assert moved < 30, f"the LoRA barely changes the image ({moved:.1f} dB): parity would prove nothing"
    assert diff.max() <= 1 and pixels <= 0.01, (diff.max(), pixels)


def test_scale_zero_is_no_lora(loras, tiny_bundle, tmp_path):
    plain = klein_image(tiny_bundle, [], tmp_path / "plain.png")
    zero = klein_image(tiny_bundle, [(loras["peft"], 0.0)], tmp_path / "zero.png")
    assert np.array_equal(plain, zero)


def test_export_time_merge_equals_diffusers(loras, tiny_checkpoint, tmp_path):
    """`convert --lora` (for quantized and static bundles): diffusers' own fuse_lora before export."""
    adapters = [(loras["bfl"], 0.7), (loras["lokr-lycoris"], -1.0)]
    bundle = convert(
        tiny_checkpoint,
        tmp_path / "merged",
        variant="tiny",
        log=lambda _: None,
        loras=[LoraSpec(path, scale) for path, scale in adapters],
    )
    want = diffusers_image(tiny_checkpoint, adapters)
    got = klein_image(bundle, [], tmp_path / "klein.png")
    diff = np.abs(got.astype(int) - want.astype(int))
    pixels = float((diff > 0).any(axis=-1).mean())
    print(f"export-time merge: max {diff.max()}, {100 * pixels:.2f}% of pixels")
    assert diff.max() <= 1 and pixels <= 0.01, (diff.max(), pixels)


def test_lora_map_covers_every_linear_layer(tiny_checkpoint, tiny_bundle):
    import json

    pipe = Flux2KleinPipeline.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    targets = json.loads((tiny_bundle / "manifest.json").read_text())["graphs"]["transformer"]["lora_targets"]
    assert sorted(targets) == sorted(linear_shapes(pipe.transformer))
    for module, target in targets.items():
        assert target["shape"] == list(linear_shapes(pipe.transformer)[module])
