"""The klein CLI against diffusers on a tiny checkpoint that no other test uses.

Another seed and other block counts and widths than the bundled model, exported with our own tool,
then other prompts, sizes, seeds and three references of different sizes and modes. klein's PNG must
equal diffusers' `Flux2KleinPipeline` image within the same tolerance as the Rust fixture tests
(tests/it/diffusers.rs): at most 1 level anywhere, in at most 1% of pixels, which is the fp32 noise
floor of these sharp random models (a 2e-5 relative change of the embeddings in diffusers itself
flips 0.2-0.5% of pixels by one level).

Needs the release binary (`cargo test --release` builds it; scripts/test.sh runs that first).
"""

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline
from diffusers.utils import load_image
from klein_binary import KLEIN
from PIL import Image

from klein_export.convert import convert
from klein_export.fixtures import synthetic_image
from klein_export.tiny import build_tiny

REPO = Path(__file__).resolve().parents[2]

CASES = [
    {
        "id": "t2i-96x64",
        "prompt": "ein Fuchs im Schnee, 日本の春",
        "seed": 2026,
        "size": (96, 64),
        "steps": 4,
        "refs": [],
    },
    {"id": "t2i-48x112-empty-prompt", "prompt": "", "seed": 5, "size": (48, 112), "steps": 2, "refs": []},
    {
        "id": "edit-explicit-size",
        "prompt": "make it night",
        "seed": 17,
        "size": (64, 80),
        "steps": 3,
        "refs": [(112, 80, "RGB")],
    },
    {
        "id": "compose-three-refs",
        "prompt": "the cat from the first image on the sofa of the second, in the style of the third",
        "seed": 99,
        "size": None,
        "steps": 4,
        "refs": [(80, 64, "RGBA"), (128, 96, "RGB"), (64, 120, "L")],
    },
]


OUT_LAYERS = (2, 5, 7)


@pytest.fixture(scope="module")
def unseen(tmp_path_factory):
    root = tmp_path_factory.mktemp("unseen")
    ckpt = build_tiny(
        root / "ckpt",
        seed=1234,
        transformer_overrides={"num_layers": 3, "num_single_layers": 1, "num_attention_heads": 3},
        # 8 text-encoder layers, 2, 5 and 7 stacked (recorded in model_index.json, given to diffusers;
        # the exporter still cuts the last): the tiny checkpoint's 28 cover the default (9, 18, 27).
        qwen_overrides={"intermediate_size": 64, "num_hidden_layers": 8},
        out_layers=OUT_LAYERS,
        vae_overrides={"block_out_channels": (32, 32, 64, 64), "norm_num_groups": 16},
    )
    bundle = convert(ckpt, root / "bundle", variant="tiny", log=lambda _: None)
    pipe = Flux2KleinPipeline.from_pretrained(str(ckpt), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe, bundle


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_klein_cli_equals_diffusers(unseen, case, tmp_path):
    assert KLEIN.is_file(), f"{KLEIN} is missing: build it with `cargo build --release` (scripts/test.sh does)"
    pipe, bundle = unseen
    ref_paths = []
    for i, (w, h, mode) in enumerate(case["refs"]):
        path = tmp_path / f"ref{i}.png"
        synthetic_image(w, h, mode, seed=case["seed"] + i).save(path)
        ref_paths.append(path)
    width, height = case["size"] or (None, None)
    with torch.no_grad():
        want = pipe(
            image=[load_image(str(p)) for p in ref_paths] or None,
            prompt=case["prompt"],
            width=width,
            height=height,
            num_inference_steps=case["steps"],
            guidance_scale=1.0,
            generator=torch.Generator("cpu").manual_seed(case["seed"]),
            text_encoder_out_layers=OUT_LAYERS,
        ).images[0]
    want = np.array(want)

    out = tmp_path / "klein.png"
    cmd = [str(KLEIN), "generate", case["prompt"], "--model", str(bundle), "--seed", str(case["seed"])]
    cmd += ["--steps", str(case["steps"]), "-o", str(out), "--quiet"]
    if case["size"]:
        cmd += ["--width", str(width), "--height", str(height)]
    for path in ref_paths:
        cmd += ["--ref", str(path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(out)
    got = np.array(Image.open(out))

    assert got.shape == want.shape
    diff = np.abs(got.astype(int) - want.astype(int))
    pixels = float((diff > 0).any(axis=-1).mean())
    print(f"{case['id']}: {got.shape[1]}x{got.shape[0]}, max diff {diff.max()}, {100 * pixels:.3f}% of pixels differ")
    assert diff.max() <= 1 and pixels <= 0.01, (diff.max(), pixels)
