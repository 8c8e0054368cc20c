"""LoRAs in klein against diffusers: every layout `Flux2LoraLoaderMixin` reads, one LoRA and two
stacked, negative and fractional scales, merged by klein at load time and by the exporter.

diffusers loads each file with `load_lora_weights` and `set_adapters(names, scales)`; klein gets the
same files with `--lora FILE:SCALE`. Tolerance: at most 1 level anywhere, in at most 1% of pixels
(as the base parity tests, test_runtime_e2e.py), or, where diffusers itself is more sensitive,
test_base_model.py's rule from diffusers' own noise floor (twice what a relative 2e-5 change of the
prompt embeddings does to its image): on an Intel Xeon host with AMX, LoKr at scale 1.5 differed by
1 level in 1.32% of pixels. Each LoRA is strong enough that the image moves
(PSNR against the image without it under 30 dB), so that equality means the LoRA was applied.

Needs the release binary (`cargo test --release` builds it; scripts/test.sh runs that first).
"""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline
from klein_binary import KLEIN
from lora_files import (
    linear_shapes,
    write_bfl,
    write_kohya,
    write_lokr_bfl,
    write_lokr_lycoris,
    write_peft,
)
from PIL import Image
from test_base_model import assert_close, noise_floor

from klein_export.cli import main
from klein_export.convert import convert
from klein_export.lora_merge import LoraSpec

REPO = Path(__file__).resolve().parents[2]
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
    """diffusers' image with `adapters` [(file, scale)] (a fresh pipeline: LoKr may fuse its QKV), and
    its noise floor (test_base_model.noise_floor)."""
    pipe = Flux2KleinPipeline.from_pretrained(str(checkpoint), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    names = []
    for i, (path, _) in enumerate(adapters):
        pipe.load_lora_weights(str(path), adapter_name=f"a{i}")
        names.append(f"a{i}")
    if names:
        pipe.set_adapters(names, [scale for _, scale in adapters])
    (image,), (floor,) = noise_floor(
        pipe, PROMPT, SEED, width=SIZE, height=SIZE, num_inference_steps=STEPS, guidance_scale=1.0
    )
    return image, floor


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
    return diffusers_image(tiny_checkpoint, [])[0]


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
    want, floor = diffusers_image(tiny_checkpoint, adapters)
    got = klein_image(tiny_bundle, adapters, tmp_path / "klein.png")
    moved = psnr(want, base_image)
    print(f"{case}: LoRA moved the image to {moved:.1f} dB")
    assert moved < 30, f"the LoRA barely changes the image ({moved:.1f} dB): parity would prove nothing"
    assert_close(got, want, floor, f"{case}: vs diffusers")


def test_scale_zero_is_no_lora(loras, tiny_bundle, tmp_path):
    plain = klein_image(tiny_bundle, [], tmp_path / "plain.png")
    zero = klein_image(tiny_bundle, [(loras["peft"], 0.0)], tmp_path / "zero.png")
    assert np.array_equal(plain, zero)


def test_export_time_merge_equals_diffusers(loras, tiny_checkpoint, tmp_path, export_cache):
    """`convert --lora` (for quantized and static bundles): diffusers' own fuse_lora before export."""
    adapters = [(loras["bfl"], 0.7), (loras["lokr-lycoris"], -1.0)]
    bundle = convert(
        tiny_checkpoint,
        tmp_path / "merged",
        variant="tiny",
        log=lambda _: None,
        loras=[LoraSpec(path, scale) for path, scale in adapters],
        cache=export_cache,  # the text encoder and VAE of tiny_bundle's convert
    )
    want, floor = diffusers_image(tiny_checkpoint, adapters)
    got = klein_image(bundle, [], tmp_path / "klein.png")
    assert_close(got, want, floor, "export-time merge")


def test_kohya_keys_diffusers_would_drop_are_refused(loras, tiny_checkpoint, tiny_bundle, tmp_path, capsys):
    """A kohya key of FLUX.1 (`guidance_in`, which FLUX.2's converter does not map): diffusers logs it
    and merges the rest; the exporter refuses the file before any export, as the runtime does."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(loras["kohya"]))
    tensors["lora_unet_guidance_in_in_layer.lora_down.weight"] = torch.zeros(4, 256, dtype=torch.float16)
    tensors["lora_unet_guidance_in_in_layer.lora_up.weight"] = torch.zeros(64, 4, dtype=torch.float16)
    lora = tmp_path / "flux1_keys.safetensors"
    save_file(tensors, str(lora))
    out = tmp_path / "out"
    assert main(["convert", "--checkpoint", str(tiny_checkpoint), "--out", str(out), "--lora", str(lora)]) == 2
    err = capsys.readouterr().err
    assert f"{lora}: 2 kohya keys name no layer of a FLUX.2 transformer" in err, err
    assert "lora_unet_guidance_in_in_layer.lora_down.weight" in err, err
    assert not out.exists()
    args = ["generate", "x", "-m", tiny_bundle, "--width", "64", "--height", "64", "--steps", "1"]
    run = subprocess.run([KLEIN, *args, "--lora", lora, "-o", tmp_path / "x.png"], capture_output=True, text=True)
    assert run.returncode == 2 and "guidance_in" in run.stderr, run.stderr
    # Half of a pair, which diffusers' converter fails on with a KeyError: named, no traceback.
    tensors = load_file(str(loras["kohya"]))
    del tensors["lora_unet_double_blocks_0_img_attn_proj.lora_up.weight"]
    save_file(tensors, str(lora))
    assert main(["convert", "--checkpoint", str(tiny_checkpoint), "--out", str(out), "--lora", str(lora)]) == 2
    err = capsys.readouterr().err
    assert f"{lora}: diffusers cannot read it as a kohya FLUX.2 LoRA (KeyError" in err and "Traceback" not in err, err


def test_lora_map_covers_every_linear_layer(tiny_checkpoint, tiny_bundle):
    pipe = Flux2KleinPipeline.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    targets = json.loads((tiny_bundle / "manifest.json").read_text())["graphs"]["transformer"]["lora_targets"]
    assert sorted(targets) == sorted(linear_shapes(pipe.transformer))
    for module, target in targets.items():
        assert target["shape"] == list(linear_shapes(pipe.transformer)[module])


def test_fp16_bundles_merge_and_quantized_ones_refuse(loras, tiny_bundle, fp16_bundle, int8_bundle, tmp_path):
    """fp16: the merged weight is rounded to float16 like the rest; its error against the fp32 bundle
    with the same LoRA is of the order of fp16's own. int8: refused, naming the export-time merge."""
    adapters = [(loras["bfl"], 0.7)]
    fp32 = klein_image(tiny_bundle, adapters, tmp_path / "fp32.png")
    fp16 = klein_image(fp16_bundle, adapters, tmp_path / "fp16.png")
    plain = psnr(klein_image(fp16_bundle, [], tmp_path / "a.png"), klein_image(tiny_bundle, [], tmp_path / "b.png"))
    with_lora = psnr(fp16, fp32)
    print(f"fp16 vs fp32: {plain:.1f} dB without the LoRA, {with_lora:.1f} dB with it")
    assert with_lora >= plain - 3, (with_lora, plain)

    manifest = json.loads((int8_bundle / "manifest.json").read_text())
    assert "lora_targets" not in manifest["graphs"]["transformer"]
    cmd = [str(KLEIN), "generate", PROMPT, "--model", str(int8_bundle), "--lora", str(loras["bfl"])]
    run = subprocess.run(cmd + ["-o", str(tmp_path / "int8.png")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert "quantized (8 bits)" in run.stderr and "klein-export convert" in run.stderr, run.stderr
    assert not (tmp_path / "int8.png").exists()


def test_lora_map_command_restores_the_map(tiny_checkpoint, tiny_bundle, tmp_path):
    copy = tmp_path / "old"
    shutil.copytree(tiny_bundle, copy)
    path = copy / "manifest.json"
    manifest = json.loads(path.read_text())
    want = manifest["graphs"]["transformer"].pop("lora_targets")
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    assert main(["lora-map", "--checkpoint", str(tiny_checkpoint), "--bundle", str(copy)]) == 0
    assert json.loads(path.read_text())["graphs"]["transformer"]["lora_targets"] == want
    assert main(["lora-map", "--checkpoint", str(tiny_checkpoint), "--bundle", str(tmp_path / "none")]) == 2


def test_external_data_bundles_merge_like_inline_ones(loras, tiny_checkpoint, tiny_bundle, fp16_bundle, tmp_path):
    """Graphs over 2 GB keep their weights in `.onnx.data`: there klein replaces the initializers
    through ONNX Runtime's external-initializer API instead of patching the graph's bytes. The
    images must be byte-equal to the inline bundle's, in fp32 and fp16."""
    import onnx

    from klein_export.lora_map import add_lora_map
    from klein_export.manifest import bundle_files, read_manifest, write_manifest

    adapters = [(loras["kohya"], 1.0), (loras["lokr-bfl"], 0.5)]
    for name, bundle in (("fp32", tiny_bundle), ("fp16", fp16_bundle)):
        external = tmp_path / name
        shutil.copytree(bundle, external)
        graph = external / "transformer.onnx"
        model = onnx.load(str(graph))
        onnx.save_model(model, str(graph), save_as_external_data=True, location="transformer.onnx.data")
        manifest = read_manifest(external)
        manifest["files"] = bundle_files(external)
        write_manifest(manifest, external)
        add_lora_map(tiny_checkpoint, external)
        targets = read_manifest(external)["graphs"]["transformer"]["lora_targets"]
        assert {t["file"] for t in targets.values()} == {"transformer.onnx.data"}
        inline = klein_image(bundle, adapters, tmp_path / f"{name}-inline.png")
        got = klein_image(external, adapters, tmp_path / f"{name}-external.png")
        assert np.array_equal(inline, got), name
