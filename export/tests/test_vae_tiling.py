"""Tiled VAE decoding and encoding against diffusers with `pipe.vae.enable_tiling()`.

The tiny checkpoint's VAE has `sample_size` 64: tiles of 64 pixels (8 latent cells) every 48
pixels (6 cells), 16 pixels blended, as the real VAE's 1024-pixel tiles every 768 scaled down, so
small images cross several tile seams in both directions. Same tolerance as every CLI-vs-diffusers
test: at most 1 level, in at most 1% of pixels.
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

from klein_export.fixtures import synthetic_image

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiled_pipe(tiny_checkpoint):
    pipe = Flux2KleinPipeline.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.enable_tiling()
    assert (pipe.vae.tile_sample_min_size, pipe.vae.tile_latent_min_size) == (64, 8)
    return pipe


def klein(bundle: Path, out: Path, *args: str) -> np.ndarray:
    assert KLEIN.is_file(), f"{KLEIN} is missing: build it with `cargo build --release` (scripts/test.sh does)"
    cmd = [str(KLEIN), "generate", "--model", str(bundle), "-o", str(out), "--quiet", *args]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return np.array(Image.open(out))


def compare(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape
    diff = np.abs(got.astype(int) - want.astype(int))
    pixels = float((diff > 0).any(axis=-1).mean())
    print(f"{what}: max diff {diff.max()}, {100 * pixels:.2f}% of pixels differ")
    assert diff.max() <= 1 and pixels <= 0.01, (diff.max(), pixels)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(float) - b.astype(float)) ** 2))
    return 10 * np.log10(255**2 / mse) if mse else float("inf")


def test_tiled_decode_matches_diffusers(tiled_pipe, tiny_bundle, tmp_path):
    # 176x112 pixels: z is 22x14 cells, tiles start at 0, 6, 12, 18 down and 0, 6, 12 across.
    with torch.no_grad():
        want = tiled_pipe(
            prompt="a harbour at night",
            width=176,
            height=112,
            num_inference_steps=3,
            guidance_scale=1.0,
            generator=torch.Generator("cpu").manual_seed(12),
        ).images[0]
    args = ["a harbour at night", "--width", "176", "--height", "112", "--steps", "3", "--seed", "12"]
    got = klein(tiny_bundle, tmp_path / "tiled.png", *args, "--vae-tiling", "on")
    compare(got, np.array(want), "tiled decode 176x112")
    assert Image.open(tmp_path / "tiled.png").text["vae_tiling"] == "on"
    # Tiling changes the image (seams are blended, not absent): equality above means it ran.
    whole = klein(tiny_bundle, tmp_path / "whole.png", *args, "--vae-tiling", "off")
    moved = psnr(got, whole)
    print(f"tiled vs whole decode: {moved:.1f} dB")
    assert moved < 45
    assert "vae_tiling" not in Image.open(tmp_path / "whole.png").text


def test_tile_size_matches_diffusers_with_that_tile(tiled_pipe, tiny_bundle, tmp_path):
    """`--vae-tile-size 128` (which turns tiling on) against diffusers with
    `tile_sample_min_size = 128` (and `tile_latent_min_size` 16): z 22x14 in tiles of 16 every 12
    cells, so 2x2 tiles, where the bundle's 64-pixel tiles make 4x3. A 192-pixel reference is
    encoded in 128-pixel tiles every 96 pixels."""
    ref = tmp_path / "ref.png"
    synthetic_image(192, 128, "RGB", seed=8).save(ref)
    vae = tiled_pipe.vae
    vae.tile_sample_min_size, vae.tile_latent_min_size = 128, 16
    try:
        with torch.no_grad():
            want = tiled_pipe(
                image=[load_image(str(ref))],
                prompt="a harbour at night",
                width=176,
                height=112,
                num_inference_steps=3,
                guidance_scale=1.0,
                generator=torch.Generator("cpu").manual_seed(12),
            ).images[0]
    finally:
        vae.tile_sample_min_size, vae.tile_latent_min_size = 64, 8
    args = ["a harbour at night", "--width", "176", "--height", "112", "--steps", "3", "--seed", "12"]
    args += ["--ref", str(ref)]
    got = klein(tiny_bundle, tmp_path / "t128.png", *args, "--vae-tile-size", "128")
    compare(got, np.array(want), "decode and encode in 128-pixel tiles")
    text = Image.open(tmp_path / "t128.png").text
    assert (text["vae_tiling"], text["vae_tile_size"]) == ("on", "128")
    default_tiles = klein(tiny_bundle, tmp_path / "t64.png", *args, "--vae-tiling", "on")
    assert psnr(got, default_tiles) < 45, "the tile size changes the seams"


@pytest.mark.parametrize("size, message", [("100", "VAE tile size 100"), ("0", "VAE tile size 0")])
def test_tile_sizes_off_the_latent_grid_are_refused(tiny_bundle, tmp_path, size, message):
    out = tmp_path / "never.png"
    cmd = [str(KLEIN), "generate", "x", "--model", str(tiny_bundle), "-o", str(out), "--vae-tile-size", size]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and "multiple of 64" in run.stderr, run.stderr
    assert not out.exists()
    off = subprocess.run([*cmd[:-2], "--vae-tile-size", "128", "--vae-tiling", "off"], capture_output=True, text=True)
    assert off.returncode == 2 and "--vae-tiling off" in off.stderr, off.stderr


def test_tiled_encode_matches_diffusers(tiled_pipe, tiny_bundle, tmp_path):
    # A 144x96 reference is encoded in 64-pixel tiles; the 64x64 output is one tile (z 8x8: no
    # decoder tiling, as in diffusers, which tiles only above the tile).
    ref = tmp_path / "ref.png"
    synthetic_image(144, 96, "RGB", seed=5).save(ref)
    with torch.no_grad():
        want = tiled_pipe(
            image=[load_image(str(ref))],
            prompt="make it autumn",
            width=64,
            height=64,
            num_inference_steps=2,
            guidance_scale=1.0,
            generator=torch.Generator("cpu").manual_seed(4),
        ).images[0]
    args = ["make it autumn", "--ref", str(ref), "--width", "64", "--height", "64", "--steps", "2", "--seed", "4"]
    got = klein(tiny_bundle, tmp_path / "tiled.png", *args, "--vae-tiling", "on")
    compare(got, np.array(want), "tiled encode of a 144x96 reference")
    whole = klein(tiny_bundle, tmp_path / "whole.png", *args, "--vae-tiling", "off")
    moved = psnr(got, whole)
    print(f"tiled vs whole encode: {moved:.1f} dB")
    assert moved < 60


def test_auto_tiles_above_one_megapixel_only(tiny_bundle, tmp_path):
    small = ["a field", "--width", "176", "--height", "112", "--steps", "1", "--seed", "3"]
    auto = klein(tiny_bundle, tmp_path / "a.png", *small)  # auto is the default
    off = klein(tiny_bundle, tmp_path / "b.png", *small, "--vae-tiling", "off")
    assert np.array_equal(auto, off)
    large = ["a field", "--width", "1040", "--height", "1024", "--steps", "1", "--seed", "3"]
    auto = klein(tiny_bundle, tmp_path / "c.png", *large)
    on = klein(tiny_bundle, tmp_path / "d.png", *large, "--vae-tiling", "on")
    assert np.array_equal(auto, on)
    assert Image.open(tmp_path / "c.png").text["vae_tiling"] == "on"
