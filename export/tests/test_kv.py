"""The KV variant (`Flux2KleinKVPipeline`) end to end: a tiny KV checkpoint no other test uses,
exported by our tool, run by the klein CLI, against diffusers' KV pipeline on the same files.

The tolerance is test_runtime_e2e.py's (at most 1 level, in at most 1% of pixels: the fp32 noise floor
of these sharp random models). A control shows the comparison is not vacuous: the plain pipeline on
the same checkpoint and references (references in the sequence at every step, modulated at the
step's timestep) gives another image.

Needs the release binary (scripts/test.sh builds it first).
"""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinKVPipeline, Flux2KleinPipeline
from diffusers.utils import load_image
from klein_binary import KLEIN
from PIL import Image

from klein_export.convert import convert
from klein_export.errors import StaticShapesError
from klein_export.fixtures import synthetic_image
from klein_export.tiny import build_tiny
from klein_export.verify import verify

REPO = Path(__file__).resolve().parents[2]

CASES = [
    {"id": "no-reference", "prompt": "a lighthouse at dusk", "seed": 3, "size": (80, 64), "refs": [], "images": 1},
    {
        "id": "one-reference",
        "prompt": "make it winter",
        "seed": 11,
        "size": None,
        "refs": [(96, 64, "RGB")],
        "images": 1,
    },
    {
        "id": "three-references",
        "prompt": "the dog of the first on the beach of the second, painted like the third",
        "seed": 29,
        "size": (64, 96),
        "refs": [(80, 64, "RGBA"), (112, 80, "RGB"), (64, 96, "L")],
        "images": 1,
    },
    {
        "id": "one-reference-two-images",
        "prompt": "",
        "seed": 47,
        "size": (64, 64),
        "refs": [(64, 80, "RGB")],
        "images": 2,
    },
]


OUT_LAYERS = (1, 2, 3)


@pytest.fixture(scope="module")
def kv(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    ckpt = build_tiny(
        root / "ckpt",
        seed=4321,
        kv=True,
        transformer_overrides={"num_layers": 2, "num_single_layers": 3, "num_attention_heads": 3},
        # 4 text-encoder layers, their outputs recorded in model_index.json (and given to diffusers):
        # the 28-layer default costs a minute of export and adds nothing the other checkpoints lack.
        qwen_overrides={"intermediate_size": 48, "num_hidden_layers": 4},
        out_layers=OUT_LAYERS,
    )
    bundle = convert(ckpt, root / "bundle", variant="tiny", log=lambda _: None)
    return ckpt, bundle


def _references(case, tmp_path):
    paths = []
    for i, (w, h, mode) in enumerate(case["refs"]):
        path = tmp_path / f"ref{i}.png"
        synthetic_image(w, h, mode, seed=case["seed"] + i).save(path)
        paths.append(path)
    return paths


def _diffusers(cls, ckpt, case, paths):
    pipe = cls.from_pretrained(str(ckpt), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    width, height = case["size"] or (None, None)
    extra = {} if cls is Flux2KleinKVPipeline else {"guidance_scale": 1.0}
    with torch.no_grad():
        images = pipe(
            image=[load_image(str(p)) for p in paths] or None,
            prompt=case["prompt"],
            width=width,
            height=height,
            num_inference_steps=4,
            num_images_per_prompt=case["images"],
            generator=torch.Generator("cpu").manual_seed(case["seed"]),
            text_encoder_out_layers=OUT_LAYERS,
            **extra,
        ).images
    return [np.array(image) for image in images]


def _klein(bundle, case, paths, out, *extra):
    cmd = [str(KLEIN), "generate", case["prompt"], "--model", str(bundle), "--seed", str(case["seed"])]
    cmd += ["-o", str(out), "--quiet", "--num-images", str(case["images"]), *extra]
    if case["size"]:
        cmd += ["--width", str(case["size"][0]), "--height", str(case["size"][1])]
    for path in paths:
        cmd += ["--ref", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _outputs(out: Path, count: int):
    if count == 1:
        return [out]
    return [out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(1, count + 1)]


def _pixels_differing(got, want):
    diff = np.abs(got.astype(int) - want.astype(int))
    return int(diff.max()), float((diff > 0).any(axis=-1).mean())


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_kv_bundle_equals_diffusers_kv_pipeline(kv, case, tmp_path):
    assert KLEIN.is_file(), f"{KLEIN} is missing: build it with `cargo build --release` (scripts/test.sh does)"
    ckpt, bundle = kv
    paths = _references(case, tmp_path)
    wants = _diffusers(Flux2KleinKVPipeline, ckpt, case, paths)
    out = tmp_path / "klein.png"
    run = _klein(bundle, case, paths, out)
    assert run.returncode == 0, run.stderr
    for path, want in zip(_outputs(out, case["images"]), wants, strict=True):
        got = np.array(Image.open(path))
        assert got.shape == want.shape
        level, pixels = _pixels_differing(got, want)
        print(f"{case['id']} {path.name}: max diff {level}, {100 * pixels:.3f}% of pixels differ")
        assert level <= 1 and pixels <= 0.01, (level, pixels)
    if case["refs"]:
        # The control: the plain pipeline's image of the same checkpoint and references differs.
        plain = _diffusers(Flux2KleinPipeline, ckpt, case, paths)[0]
        level, pixels = _pixels_differing(np.array(Image.open(_outputs(out, case["images"])[0])), plain)
        print(f"{case['id']}: against the plain pipeline, max diff {level}, {100 * pixels:.1f}% of pixels")
        assert level > 8 and pixels > 0.2, (level, pixels)


def test_kv_manifest_and_graph_check(kv):
    """The manifest says KV, and `verify` finds the graph's three modes equal to the torch module."""
    ckpt, bundle = kv
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["model"]["kv_cache"] is True
    inputs = [t["name"] for t in manifest["graphs"]["transformer"]["inputs"]]
    assert inputs[-3:] == ["ref_latents", "ref_ids", "cached_kv"]
    results = list(verify(ckpt, bundle, components=("transformer",)))
    assert [r.case.split(":")[0] for r in results] == ["extract", "cached", "no references"]
    assert all(r.ok for r in results), [str(r) for r in results]


def test_kv_bundle_refuses_inpainting(kv, tmp_path):
    _, bundle = kv
    source = tmp_path / "source.png"
    synthetic_image(64, 64, "RGB", seed=1).save(source)
    out = tmp_path / "out.png"
    case = {"prompt": "x", "seed": 1, "size": None, "images": 1}
    run = _klein(bundle, case, [], out, "--image", str(source))
    assert run.returncode == 2, run.stderr
    assert "KV bundle" in run.stderr and "inpaint" in run.stderr
    assert not out.exists()


def test_kv_checkpoint_refuses_static_shapes(kv, tmp_path):
    ckpt, _ = kv
    with pytest.raises(StaticShapesError, match="KV checkpoint"):
        convert(ckpt, tmp_path / "static", static_shapes="64x64", log=lambda _: None)
    assert not (tmp_path / "static").exists()
