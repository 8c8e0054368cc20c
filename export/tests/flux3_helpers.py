"""What the FLUX.3 test files share: the tiny checkpoints' bundles, the klein CLI and the comparison
with diffusers (max 1 level in at most 1% of pixels, as test_runtime_e2e.py)."""

import json
import subprocess
from pathlib import Path

import numpy as np
from export_cache_dir import EXPORT_CACHE
from klein_binary import KLEIN
from PIL import Image

from klein_export.convert import convert
from klein_export.flux3_reference import load_reference
from klein_export.flux3_tiny import build_flux3

REPO = Path(__file__).resolve().parents[2]
# Widths and depths no other test uses.
UNSEEN = {"num_layers": 2, "num_single_layers": 1, "num_attention_heads": 3}


def flux3_bundle(root, seed, distilled, text_overrides, out_layers=None):
    ckpt = build_flux3(
        root / "ckpt",
        seed=seed,
        distilled=distilled,
        transformer_overrides=UNSEEN,
        text_overrides=text_overrides,
        out_layers=out_layers,
    )
    bundle = convert(ckpt, root / "bundle", log=lambda _: None, cache=EXPORT_CACHE)
    return load_reference(ckpt), bundle


def small_distilled(root):
    """A step-distilled checkpoint with 7 Qwen3-VL layers, layers 2, 4 and 6 stacked (recorded in its
    index; the last is a raw layer output), UNSEEN's transformer with joint attention width 3 x 16.
    The same bytes for every caller: their converts share the export cache."""
    overrides = {**UNSEEN, "joint_attention_dim": 3 * 16}
    text = {"num_hidden_layers": 7, "intermediate_size": 28}
    return build_flux3(root, seed=33, transformer_overrides=overrides, text_overrides=text, out_layers=(2, 4, 6))


def klein_cli(bundle, prompt, seed, out, size=None, steps=None, extra=()):
    assert KLEIN.is_file(), f"{KLEIN} is missing: build it with `cargo build --release` (scripts/test.sh does)"
    cmd = [str(KLEIN), "generate", prompt, "--model", str(bundle), "--seed", str(seed), "-o", str(out), "--quiet"]
    if size:
        cmd += ["--width", str(size[0]), "--height", str(size[1])]
    if steps:
        cmd += ["--steps", str(steps)]
    run = subprocess.run(cmd + list(extra), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run


def compare_png(got_path, want, label):
    got = np.array(Image.open(got_path).convert("RGB"))
    want = np.array(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    diff = np.abs(got.astype(int) - want.astype(int))
    pixels = float((diff > 0).any(axis=-1).mean())
    print(f"{label}: {got.shape[1]}x{got.shape[0]}, max diff {diff.max()}, {100 * pixels:.3f}% of pixels differ")
    assert diff.max() <= 1 and pixels <= 0.01, (diff.max(), pixels)


def check_manifest(bundle, steps, guidance, flow_map):
    """The manifest names the family and the recipe: steps, guidance, size, shift, window, inputs."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["model"]["family"] == "flux3"
    assert (manifest["model"]["default_steps"], manifest["model"]["default_guidance"]) == (steps, guidance)
    assert manifest["model"]["default_width"] == manifest["model"]["default_height"] == 1024
    assert manifest["transformer"]["flow_map"] is flow_map
    assert manifest["scheduler"]["shift"] == 6.93 and manifest["scheduler"]["use_dynamic_shifting"] is False
    assert manifest["tokenizer"]["pad_multiple"] == 80 and manifest["tokenizer"]["max_sequence_length"] == 8192
    inputs = [t["name"] for t in manifest["graphs"]["transformer"]["inputs"]]
    assert ("target_timestep" in inputs) is flow_map and "cond_latents" in inputs
