"""FLUX.3 Image Klein: the klein CLI against diffusers' FLUX.3 modular pipelines.

A tiny random-weight step-distilled checkpoint built with the real classes (flux3_tiny.py), with
widths and depths no other test uses (33 Qwen3-VL layers, so that stacked layer 32 is a raw layer
output), converted with our own tool; klein's PNG must equal `Flux3DistilledModularPipeline` (without
the prompt upsampler) for the same seed within flux3_helpers' tolerance. The base checkpoint's tests
are in test_flux3_base.py (a file of their own: the two run in parallel).
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from diffusers.utils import load_image
from flux3_helpers import KLEIN, check_manifest, compare_png, flux3_bundle, klein_cli
from PIL import Image

from klein_export.fixtures import synthetic_image
from klein_export.flux3 import Flux3Checkpoint
from klein_export.flux3_convert import tokenizer_facts
from klein_export.flux3_reference import run_reference

# About 100 tokens once templated: a window of 160, not 80.
LONG = "a watercolour of a lighthouse on a cliff at dawn, " * 9


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    return flux3_bundle(
        tmp_path_factory.mktemp("flux3-distilled"), 31, True, {"num_hidden_layers": 33, "intermediate_size": 40}
    )


DISTILLED_CASES = [
    {"id": "t2i-96x64", "prompt": "ein Fuchs im Schnee, 日本の春", "seed": 2026, "size": (96, 64), "steps": 3},
    {"id": "empty-prompt-48x112", "prompt": "", "seed": 5, "size": (48, 112), "steps": 2},
    {"id": "long-prompt-window-160", "prompt": LONG, "seed": 9, "size": (64, 64), "steps": 2},
]


@pytest.mark.parametrize("case", DISTILLED_CASES, ids=[c["id"] for c in DISTILLED_CASES])
def test_distilled_equals_diffusers(distilled, case, tmp_path):
    pipe, bundle = distilled
    want = run_reference(pipe, case["prompt"], case["seed"], *case["size"], steps=case["steps"], output_type="pil")
    klein_cli(bundle, case["prompt"], case["seed"], tmp_path / "k.png", case["size"], case["steps"])
    compare_png(tmp_path / "k.png", want[0], case["id"])


def test_distilled_batch_and_default_steps_equal_diffusers(distilled, tmp_path):
    """Two images of one prompt from one seed (num_images_per_prompt), at the default 16 steps."""
    pipe, bundle = distilled
    want = run_reference(pipe, "two foxes", 77, 32, 48, output_type="pil", num_images=2)
    klein_cli(bundle, "two foxes", 77, tmp_path / "k.png", (32, 48), extra=["--num-images", "2"])
    for i in (0, 1):
        compare_png(tmp_path / f"k-{i + 1}.png", want[i], f"batch image {i + 1}")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["model"]["default_steps"] == 16


REFERENCE_CASES = [
    # One reference: kept whole on its padded canvas, the output cropped back to it.
    {"id": "one-ref-reflect-padded", "refs": [(100, 70, "RGBA")], "size": None},
    {"id": "one-ref-canvas-min-side", "refs": [(40, 30, "RGB")], "size": None},
    {"id": "one-ref-symmetric-padded", "refs": [(16, 96, "L")], "size": None},
    # A size given: the canvas is not cropped back.
    {"id": "one-ref-sized", "refs": [(100, 70, "RGB")], "size": (64, 48)},
    # Several: each centre-cropped to the grid, told apart on the l axis.
    {"id": "two-refs", "refs": [(80, 64, "RGB"), (128, 96, "RGB")], "size": None},
    {"id": "three-refs-sized", "refs": [(80, 64, "RGBA"), (128, 96, "RGB"), (64, 120, "L")], "size": (64, 64)},
]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=[c["id"] for c in REFERENCE_CASES])
def test_references_equal_diffusers(distilled, case, tmp_path):
    pipe, bundle = distilled
    paths = []
    for i, (w, h, mode) in enumerate(case["refs"]):
        paths.append(tmp_path / f"ref{i}.png")
        synthetic_image(w, h, mode, seed=40 + i).save(paths[-1])
    images = [load_image(str(p)) for p in paths]
    width, height = case["size"] or (None, None)
    want = run_reference(
        pipe,
        "make it night",
        4,
        width,
        height,
        steps=2,
        output_type="pil",
        images=images if len(images) > 1 else images[0],
    )
    extra = [arg for p in paths for arg in ("--ref", str(p))]
    klein_cli(bundle, "make it night", 4, tmp_path / "k.png", case["size"], 2, extra)
    compare_png(tmp_path / "k.png", want[0], case["id"])


def test_inpainting_is_refused_by_name(distilled, tmp_path):
    _, bundle = distilled
    synthetic_image(64, 64, "RGB", seed=1).save(tmp_path / "src.png")
    cmd = [
        str(KLEIN),
        "generate",
        "x",
        "--model",
        str(bundle),
        "--image",
        str(tmp_path / "src.png"),
        "-o",
        str(tmp_path / "k.png"),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "FLUX.3 Image Klein bundle, which has no inpainting or img2img" in run.stderr
    assert not (tmp_path / "k.png").exists()


def test_manifest_names_the_family_and_the_recipe(distilled):
    check_manifest(distilled[1], 16, 1.0, True)


def test_older_tokenizer_layout_gives_the_same_recipe(distilled, tmp_path):
    """`preprocessor_config.json` + `chat_template.json`, as older Qwen3-VL repositories ship them."""
    pipe, _ = distilled
    ckpt = Path(pipe.klein_root)
    old = tmp_path / "old"
    shutil.copytree(ckpt, old)
    tok = old / "tokenizer"
    template = (tok / "chat_template.jinja").read_text()
    (tok / "chat_template.jinja").unlink()
    (tok / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    processor = json.loads((tok / "processor_config.json").read_text())
    (tok / "processor_config.json").unlink()
    (tok / "preprocessor_config.json").write_text(json.dumps(processor["image_processor"]))
    facts = tokenizer_facts(Flux3Checkpoint(old).load_processor())
    assert facts == tokenizer_facts(Flux3Checkpoint(ckpt).load_processor())
    assert facts["prompt_prefix"] == "<|im_start|>user\n"
    assert facts["prompt_suffix"] == "<|im_end|>\n<|im_start|>assistant\n"


def test_fast_paths_not_yet_available_are_refused(distilled, tmp_path):
    pipe, _ = distilled
    run = subprocess.run(
        [
            "klein-export",
            "convert",
            "--checkpoint",
            str(pipe.klein_root),
            "--out",
            str(tmp_path / "b"),
            "--static-shapes",
            "64x64",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert "--static-shapes is not available for FLUX.3 Image Klein" in run.stderr
    assert not (tmp_path / "b").exists()


def test_verify_checks_each_graph_and_the_image(distilled):
    """`klein-export verify` on a FLUX.3 bundle: every graph against torch (no references, one, two;
    windows 80 and 160), and the bundle's image, run by ONNX Runtime, against diffusers."""
    pipe, bundle = distilled
    run = subprocess.run(
        ["klein-export", "verify", "--checkpoint", str(pipe.klein_root), "--bundle", str(bundle), "--size", "64"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert sum(line.startswith(("text_encoder", "transformer", "vae_")) for line in lines) == 11, run.stdout
    assert any(line.startswith("image") and "16 steps" in line and line.endswith("ok") for line in lines)
    assert lines[-1] == "passed: 0 case(s) past tolerance"


def test_prompt_cache_and_previews(distilled, tmp_path):
    """The prompt cache keeps FLUX.3's variable windows (a hit gives the same bytes), and step
    previews come from the bundle's preview map."""
    _, bundle = distilled
    cache = tmp_path / "cache"
    extra = ["--prompt-cache", str(cache), "--preview", str(tmp_path / "preview.png"), "--preview-every", "1"]
    klein_cli(bundle, LONG, 3, tmp_path / "a.png", (48, 48), 2, extra)
    assert len(list(cache.rglob("*.safetensors"))) == 1
    assert Image.open(tmp_path / "preview.png").size == (6, 6)
    run = klein_cli(bundle, LONG, 3, tmp_path / "b.png", (48, 48), 2, ["--prompt-cache", str(cache), "--timings"])
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    # The second run took the embeddings from the cache: the text encoder never loaded.
    assert "transformer: runs on cpu" in run.stderr and "text_encoder: runs on" not in run.stderr, run.stderr
