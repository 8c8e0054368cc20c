"""FLUX.3 Image Klein: the klein CLI against diffusers' FLUX.3 modular pipelines.

Two tiny random-weight checkpoints built with the real classes (flux3_tiny.py), with widths and
depths no other test uses: a step-distilled one (flow map, 33 Qwen3-VL layers, so that stacked layer
32 is a raw layer output) and a base one (32 layers: layer 32 is the final-normed output). Each is
converted with our own tool, then klein's PNG must equal `Flux3DistilledModularPipeline` /
`Flux3ModularPipeline` (without the prompt upsampler) for the same seed within the tolerance of the
FLUX.2 end-to-end tests (test_runtime_e2e.py): at most 1 level anywhere, in at most 1% of pixels.
"""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from diffusers.utils import load_image
from PIL import Image

from klein_export.convert import convert
from klein_export.fixtures import synthetic_image
from klein_export.flux3 import Flux3Checkpoint
from klein_export.flux3_convert import tokenizer_facts
from klein_export.flux3_reference import load_reference, run_reference
from klein_export.flux3_tiny import build_flux3

REPO = Path(__file__).resolve().parents[2]
KLEIN = REPO / "target" / "release" / "klein"
# About 100 tokens once templated: a window of 160, not 80.
LONG = "a watercolour of a lighthouse on a cliff at dawn, " * 9
UNSEEN = {"num_layers": 2, "num_single_layers": 1, "num_attention_heads": 3}


def _bundle(root, seed, distilled, text_overrides):
    ckpt = build_flux3(
        root / "ckpt", seed=seed, distilled=distilled, transformer_overrides=UNSEEN, text_overrides=text_overrides
    )
    bundle = convert(ckpt, root / "bundle", log=lambda _: None)
    return load_reference(ckpt), bundle


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    return _bundle(
        tmp_path_factory.mktemp("flux3-distilled"), 31, True, {"num_hidden_layers": 33, "intermediate_size": 40}
    )


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return _bundle(tmp_path_factory.mktemp("flux3-base"), 32, False, {"intermediate_size": 24})


def _klein(bundle, prompt, seed, out, size=None, steps=None, extra=()):
    assert KLEIN.is_file(), f"{KLEIN} is missing: build it with `cargo build --release` (scripts/test.sh does)"
    cmd = [str(KLEIN), "generate", prompt, "--model", str(bundle), "--seed", str(seed), "-o", str(out), "--quiet"]
    if size:
        cmd += ["--width", str(size[0]), "--height", str(size[1])]
    if steps:
        cmd += ["--steps", str(steps)]
    run = subprocess.run(cmd + list(extra), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run


def _compare(got_path, want, label):
    got = np.array(Image.open(got_path).convert("RGB"))
    want = np.array(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    diff = np.abs(got.astype(int) - want.astype(int))
    pixels = float((diff > 0).any(axis=-1).mean())
    print(f"{label}: {got.shape[1]}x{got.shape[0]}, max diff {diff.max()}, {100 * pixels:.3f}% of pixels differ")
    assert diff.max() <= 1 and pixels <= 0.01, (diff.max(), pixels)


DISTILLED_CASES = [
    {"id": "t2i-96x64", "prompt": "ein Fuchs im Schnee, 日本の春", "seed": 2026, "size": (96, 64), "steps": 3},
    {"id": "empty-prompt-48x112", "prompt": "", "seed": 5, "size": (48, 112), "steps": 2},
    {"id": "long-prompt-window-160", "prompt": LONG, "seed": 9, "size": (64, 64), "steps": 2},
]


@pytest.mark.parametrize("case", DISTILLED_CASES, ids=[c["id"] for c in DISTILLED_CASES])
def test_distilled_equals_diffusers(distilled, case, tmp_path):
    pipe, bundle = distilled
    want = run_reference(pipe, case["prompt"], case["seed"], *case["size"], steps=case["steps"], output_type="pil")
    _klein(bundle, case["prompt"], case["seed"], tmp_path / "k.png", case["size"], case["steps"])
    _compare(tmp_path / "k.png", want[0], case["id"])


def test_distilled_batch_and_default_steps_equal_diffusers(distilled, tmp_path):
    """Two images of one prompt from one seed (num_images_per_prompt), at the default 16 steps."""
    pipe, bundle = distilled
    want = run_reference(pipe, "two foxes", 77, 32, 48, output_type="pil", num_images=2)
    _klein(bundle, "two foxes", 77, tmp_path / "k.png", (32, 48), extra=["--num-images", "2"])
    for i in (0, 1):
        _compare(tmp_path / f"k-{i + 1}.png", want[i], f"batch image {i + 1}")
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
    _klein(bundle, "make it night", 4, tmp_path / "k.png", case["size"], 2, extra)
    _compare(tmp_path / "k.png", want[0], case["id"])


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


BASE_CASES = [
    {"id": "default-guidance-3.5", "prompt": "a red fox", "seed": 1, "size": (96, 64), "steps": 3, "kw": {}},
    {
        "id": "negative-prompt-longer-window",
        "prompt": "a red fox in the snow",
        "seed": 2,
        "size": (64, 64),
        "steps": 2,
        "kw": {"negative_prompt": ", ".join(["blurry"] * 60), "guidance": 2.5},
    },
]


@pytest.mark.parametrize("case", BASE_CASES, ids=[c["id"] for c in BASE_CASES])
def test_base_equals_diffusers(base, case, tmp_path):
    pipe, bundle = base
    kw = case["kw"]
    want = run_reference(
        pipe, case["prompt"], case["seed"], *case["size"], steps=case["steps"], output_type="pil", **kw
    )
    extra = []
    if "negative_prompt" in kw:
        extra += ["--negative-prompt", kw["negative_prompt"]]
    if "guidance" in kw:
        extra += ["--guidance", str(kw["guidance"])]
    _klein(bundle, case["prompt"], case["seed"], tmp_path / "k.png", case["size"], case["steps"], extra)
    _compare(tmp_path / "k.png", want[0], case["id"])


def test_manifest_names_the_family_and_the_recipe(distilled, base):
    for (_, bundle), steps, guidance, flow_map in ((distilled, 16, 1.0, True), (base, 50, 3.5, False)):
        manifest = json.loads((bundle / "manifest.json").read_text())
        assert manifest["model"]["family"] == "flux3"
        assert (manifest["model"]["default_steps"], manifest["model"]["default_guidance"]) == (steps, guidance)
        assert manifest["model"]["default_width"] == manifest["model"]["default_height"] == 1024
        assert manifest["transformer"]["flow_map"] is flow_map
        assert manifest["scheduler"]["shift"] == 6.93 and manifest["scheduler"]["use_dynamic_shifting"] is False
        assert manifest["tokenizer"]["pad_multiple"] == 80 and manifest["tokenizer"]["max_sequence_length"] == 8192
        inputs = [t["name"] for t in manifest["graphs"]["transformer"]["inputs"]]
        assert ("target_timestep" in inputs) is flow_map and "cond_latents" in inputs


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
            "--precision",
            "fp16",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert "--precision fp16 is not available for FLUX.3 Image Klein" in run.stderr
    assert not (tmp_path / "b").exists()


def test_python_bindings_follow_the_family(base, tmp_path):
    """`klein_runtime.Pipeline` on the base bundle: one reference (cropped back), guidance 2 and a
    negative prompt, as diffusers; no option names the family."""
    import klein_runtime

    pipe, bundle = base
    klein = klein_runtime.Pipeline(bundle)
    assert (klein.family, klein.default_steps, klein.default_guidance) == ("flux3", 50, 3.5)
    synthetic_image(100, 70, "RGB", seed=8).save(tmp_path / "ref.png")
    kw = {"negative_prompt": "fog", "guidance": 2.0}
    want = run_reference(
        pipe, "a boat", 6, steps=2, output_type="pil", images=load_image(str(tmp_path / "ref.png")), **kw
    )
    got = klein(
        "a boat",
        image=tmp_path / "ref.png",
        num_inference_steps=2,
        generator=6,
        negative_prompt="fog",
        guidance_scale=2.0,
    ).images[0]
    got.save(tmp_path / "k.png")
    _compare(tmp_path / "k.png", want[0], "python, base, one reference")


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
