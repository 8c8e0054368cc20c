"""FLUX.3 Image Klein LoRAs: the klein CLI with `--lora` against diffusers' FLUX.3 modular pipeline
with `load_lora_weights` (`Flux3LoraLoaderMixin`), and each family's LoRA refused on the other's
bundle by name.

The checkpoint is flux3_helpers.small_distilled (its converts share the export cache with
test_flux3_quantized.py). The LoRAs are on every linear layer of the transformer, the per-image
modulation projections included: one saved by diffusers/PEFT, one in BFL names
(`_convert_non_diffusers_flux3_lora_to_diffusers` renames them). Tolerance: flux3_helpers'
(at most 1 level in at most 1% of pixels), as without a LoRA.
"""

import json
import subprocess

import pytest
import torch
from flux3_helpers import KLEIN, REPO, compare_png, klein_cli, small_distilled
from lora_files import linear_shapes, write_peft
from safetensors.torch import save_file

from klein_export.convert import convert
from klein_export.flux3 import Flux3Checkpoint
from klein_export.flux3_reference import load_reference, run_reference

PROMPT, SEED, SIZE, STEPS = "a lighthouse at dusk", 11, (64, 48), 3
# diffusers' module paths -> BFL's, the inverse of _convert_non_diffusers_flux3_lora_to_diffusers.
TO_BFL = (
    (".attn.to_q.", ".q_proj."),
    (".attn.to_k.", ".k_proj."),
    (".attn.to_v.", ".v_proj."),
    (".attn.to_out.0.", ".attn_out."),
    (".ff.linear_in.", ".mlp_in."),
    (".ff.linear_out.", ".mlp_out."),
)


def bfl_name(module):
    name = f"{module}."
    if name.startswith("mode_blocks."):
        name = "content_" + name
    name = name.replace("single_transformer_blocks.", "single_blocks.")
    for diffusers, bfl in TO_BFL:
        name = name.replace(diffusers, bfl)
    return name.rstrip(".")


def write_flux3_bfl(shapes, path, rank=4, std=0.1, seed=1):
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out, inp) in shapes.items():
        tensors[f"diffusion_model.{bfl_name(module)}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * std
        tensors[f"diffusion_model.{bfl_name(module)}.lora_B.weight"] = torch.randn(out, rank, generator=g) * std
    save_file(tensors, str(path))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from diffusers.modular_pipelines import Flux3ModularPipeline
    from export_cache_dir import EXPORT_CACHE

    root = tmp_path_factory.mktemp("flux3-lora")
    ckpt = small_distilled(root / "ckpt")
    bundle = convert(ckpt, root / "bundle", log=lambda _: None, cache=EXPORT_CACHE)
    transformer = Flux3Checkpoint(ckpt).load_transformer()
    shapes = linear_shapes(transformer)
    loras = {
        "peft": write_peft(transformer, root / "peft.safetensors", pipeline=Flux3ModularPipeline),
        "bfl": write_flux3_bfl(shapes, root / "bfl.safetensors"),
    }
    return ckpt, bundle, loras


def diffusers_image(ckpt, adapters):
    pipe = load_reference(ckpt)
    names = []
    for i, (path, _) in enumerate(adapters):
        pipe.load_lora_weights(str(path), adapter_name=f"a{i}")
        names.append(f"a{i}")
    pipe.set_adapters(names, [scale for _, scale in adapters])
    return run_reference(pipe, PROMPT, SEED, *SIZE, steps=STEPS, output_type="pil")[0]


CASES = {"peft": [("peft", 1.0)], "bfl-fractional": [("bfl", 0.7)], "stacked-negative": [("peft", 0.6), ("bfl", -0.8)]}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_lora_equals_diffusers(setup, case, tmp_path):
    ckpt, bundle, loras = setup
    adapters = [(loras[name], scale) for name, scale in CASES[case]]
    want = diffusers_image(ckpt, adapters)
    extra = [arg for path, scale in adapters for arg in ("--lora", f"{path}:{scale}")]
    klein_cli(bundle, PROMPT, SEED, tmp_path / "k.png", SIZE, STEPS, extra)
    compare_png(tmp_path / "k.png", want, case)


def test_the_lora_changes_the_image(setup, tmp_path):
    """Without it the image differs: the comparison above is not of two unchanged images."""
    _, bundle, loras = setup
    klein_cli(bundle, PROMPT, SEED, tmp_path / "a.png", SIZE, STEPS)
    klein_cli(bundle, PROMPT, SEED, tmp_path / "b.png", SIZE, STEPS, ["--lora", f"{loras['peft']}:1.0"])
    assert (tmp_path / "a.png").read_bytes() != (tmp_path / "b.png").read_bytes()


def _refused(bundle, lora, tmp_path):
    out = tmp_path / "k.png"
    cmd = [str(KLEIN), "generate", PROMPT, "--model", str(bundle), "--lora", str(lora), "-o", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert not out.exists()
    return run.stderr


FLUX2_KEYS = {
    "diffusers": "transformer.transformer_blocks.0.attn.to_q",
    "bfl": "diffusion_model.double_blocks.0.img_attn.qkv",
    "single-fused": "transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj",
}


@pytest.mark.parametrize("layout", FLUX2_KEYS)
def test_a_flux2_lora_is_refused_on_a_flux3_bundle_by_name(setup, layout, tmp_path):
    _, bundle, _ = setup
    base = FLUX2_KEYS[layout]
    lora = tmp_path / "flux2.safetensors"
    save_file({f"{base}.lora_A.weight": torch.zeros(2, 8), f"{base}.lora_B.weight": torch.zeros(8, 2)}, str(lora))
    err = _refused(bundle, lora, tmp_path)
    assert "a FLUX.2-klein LoRA" in err and "this bundle is FLUX.3 Image Klein" in err, err


def test_a_flux3_lora_is_refused_on_a_flux2_bundle_by_name(setup, tmp_path):
    _, _, loras = setup
    err = _refused(REPO / "onnx" / "klein-tiny", loras["bfl"], tmp_path)
    assert "a FLUX.3 Image Klein LoRA" in err and "this bundle is FLUX.2-klein" in err, err


def test_kohya_and_lokr_files_are_refused_for_flux3(setup, tmp_path):
    """diffusers' FLUX.3 loader converts neither."""
    _, bundle, _ = setup
    base = "lora_unet_single_blocks_0_mlp_in"
    lora = tmp_path / "kohya.safetensors"
    save_file({f"{base}.lora_down.weight": torch.zeros(2, 8), f"{base}.lora_up.weight": torch.zeros(8, 2)}, str(lora))
    assert "a kohya LoRA" in _refused(bundle, lora, tmp_path)
    lora = tmp_path / "lokr.safetensors"
    save_file({"diffusion_model.single_blocks.0.mlp_in.lokr_w1": torch.zeros(2, 2)}, str(lora))
    assert "a LoKr adapter" in _refused(bundle, lora, tmp_path)


def test_export_time_merge_equals_diffusers(setup, tmp_path):
    """`convert --lora` on a FLUX.3 checkpoint (for quantized bundles): diffusers' FLUX.3 loader merges
    the stacked LoRAs before export; the bundle, run with no --lora, gives diffusers' image with them
    (flux3_helpers' tolerance), and its manifest names them."""
    from export_cache_dir import EXPORT_CACHE

    from klein_export.lora_merge import LoraSpec

    ckpt, _, loras = setup
    adapters = [(loras[name], scale) for name, scale in CASES["stacked-negative"]]
    specs = [LoraSpec(path, scale) for path, scale in adapters]
    # The text encoder and VAE come from the export cache (setup's convert): only the transformer exports.
    merged = convert(ckpt, tmp_path / "merged", log=lambda _: None, loras=specs, cache=EXPORT_CACHE)
    listed = json.loads((merged / "manifest.json").read_text())["model"]["loras"]
    assert [(e["file"], e["scale"]) for e in listed] == [(p.name, s) for p, s in adapters], listed
    klein_cli(merged, PROMPT, SEED, tmp_path / "k.png", SIZE, STEPS)
    compare_png(tmp_path / "k.png", diffusers_image(ckpt, adapters), "export-time merge")


def test_export_time_merge_refuses_what_the_flux3_loader_cannot_read(setup, tmp_path, capsys):
    """kohya and LoKr files, and a FLUX.2 LoRA, are refused before anything is exported (exit 2)."""
    from klein_export.cli import main

    ckpt, _, _ = setup
    kohya = tmp_path / "kohya.safetensors"
    base = "lora_unet_single_blocks_0_mlp_in"
    save_file({f"{base}.lora_down.weight": torch.ones(2, 8), f"{base}.lora_up.weight": torch.ones(8, 2)}, str(kohya))
    lokr = tmp_path / "lokr.safetensors"
    save_file({"diffusion_model.single_blocks.0.mlp_in.lokr_w1": torch.ones(2, 2)}, str(lokr))
    flux2 = tmp_path / "flux2.safetensors"
    key = "transformer.transformer_blocks.0.attn.to_q"
    save_file({f"{key}.lora_A.weight": torch.ones(2, 8), f"{key}.lora_B.weight": torch.ones(8, 2)}, str(flux2))
    cases = ((kohya, "a kohya LoRA"), (lokr, "a LoKr adapter"), (flux2, "match no linear layer of this transformer"))
    for lora, needle in cases:
        out = tmp_path / f"out-{lora.stem}"
        code = main(["convert", "--checkpoint", str(ckpt), "--out", str(out), "--lora", str(lora)])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and str(lora) in err, err
        assert "Traceback" not in err and "exporting" not in err and not out.exists(), err
