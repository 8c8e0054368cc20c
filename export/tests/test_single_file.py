"""`klein-export convert --transformer FILE`: a fine-tuned transformer shipped as one .safetensors
file, in BFL's key names (as BFL and most fine-tunes ship it), ComfyUI's (the same under
`model.diffusion_model.`, beside the other models' keys) or diffusers'. The file is written here
from another tiny checkpoint's transformer by the inverse of diffusers' own key mapping; the bundle's
transformer must hold exactly that checkpoint's weights (read back through the manifest's LoRA map,
which records where each linear layer's weight is), its other graphs the base checkpoint's."""

import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from klein_export.against import check_same_model
from klein_export.checkpoint import Checkpoint
from klein_export.cli import main
from klein_export.errors import BundleError
from klein_export.tiny import build_tiny

# diffusers -> BFL: the inverse of diffusers' FLUX2_TRANSFORMER_KEYS_RENAME_DICT and block maps
# (convert_flux2_transformer_checkpoint_to_diffusers, diffusers 0.42.1).
RENAME = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear",
}
DOUBLE = {
    "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
    "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
    "attn.to_out.0.weight": "img_attn.proj.weight",
    "ff.linear_in.weight": "img_mlp.0.weight",
    "ff.linear_out.weight": "img_mlp.2.weight",
    "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
    "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
    "attn.to_add_out.weight": "txt_attn.proj.weight",
    "ff_context.linear_in.weight": "txt_mlp.0.weight",
    "ff_context.linear_out.weight": "txt_mlp.2.weight",
}
SINGLE = {
    "attn.to_qkv_mlp_proj.weight": "linear1.weight",
    "attn.to_out.weight": "linear2.weight",
    "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale",
}
QKV = {"img_attn": ("to_q", "to_k", "to_v"), "txt_attn": ("add_q_proj", "add_k_proj", "add_v_proj")}


def to_bfl(state_dict: dict) -> dict:
    """A diffusers Flux2Transformer2DModel state dict under BFL's names: Q, K and V fused, the final
    modulation as (shift, scale), norms' weights as `scale`."""
    out, qkv = {}, {}
    for key, tensor in state_dict.items():
        double = re.fullmatch(r"transformer_blocks\.(\d+)\.(.*)", key)
        single = re.fullmatch(r"single_transformer_blocks\.(\d+)\.(.*)", key)
        if double and double[2] in DOUBLE:
            out[f"double_blocks.{double[1]}.{DOUBLE[double[2]]}"] = tensor
        elif double:
            qkv[(double[1], double[2].removeprefix("attn.").removesuffix(".weight"))] = tensor
        elif single:
            out[f"single_blocks.{single[1]}.{SINGLE[single[2]]}"] = tensor
        elif key == "norm_out.linear.weight":
            out["final_layer.adaLN_modulation.1.weight"] = torch.cat(tensor.chunk(2)[::-1])
        else:
            module, param = key.rsplit(".", 1)
            out[f"{RENAME[module]}.{param}"] = tensor
    for block in sorted({block for block, _ in qkv}):
        for stream, parts in QKV.items():
            out[f"double_blocks.{block}.{stream}.qkv.weight"] = torch.cat([qkv[(block, p)] for p in parts])
    return out


@pytest.fixture(scope="module")
def finetune(tmp_path_factory):
    """Another tiny checkpoint's transformer (another seed), and that file in BFL's names."""
    root = tmp_path_factory.mktemp("finetune")
    checkpoint = build_tiny(root / "other", seed=7)
    weights = load_file(str(checkpoint / "transformer" / "diffusion_pytorch_model.safetensors"))
    bfl = root / "finetune.safetensors"
    save_file(to_bfl(weights), str(bfl))
    return weights, bfl


def linear_weights(bundle) -> dict:
    """module -> its weight [out, in] as the bundle's transformer graph holds it (the LoRA map)."""
    targets = json.loads((bundle / "manifest.json").read_text())["graphs"]["transformer"]["lora_targets"]
    weights = {}
    for module, t in targets.items():
        data = (bundle / t["file"]).read_bytes()[t["offset"] : t["offset"] + t["bytes"]]
        out, inp = t["shape"]
        array = np.frombuffer(data, dtype=np.float32)
        weights[module] = array.reshape(out, inp) if t["layout"] == "out_in" else array.reshape(inp, out).T
    return weights


@pytest.fixture(scope="module")
def exported(finetune, tiny_checkpoint, tmp_path_factory, export_cache):
    """The base checkpoint converted with the BFL file as its transformer (the text encoder and VAE
    from the export cache)."""
    out = tmp_path_factory.mktemp("single-file") / "bundle"
    args = ["convert", "--checkpoint", str(tiny_checkpoint), "--transformer", str(finetune[1]), "--out", str(out)]
    args += ["--cache", str(export_cache)]
    assert main(args) == 0
    return out


def test_a_bfl_single_file_transformer_is_exported(finetune, exported, tiny_bundle):
    weights, _ = finetune
    out = exported
    exported, base = linear_weights(out), linear_weights(tiny_bundle)
    assert len(exported) == 37
    for module, weight in exported.items():
        np.testing.assert_array_equal(weight, weights[f"{module}.weight"].numpy(), err_msg=module)
        assert not np.array_equal(weight, base[module]), f"{module} is the base checkpoint's"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["transformer_file"]["file"] == "finetune.safetensors"
    ours, theirs = manifest["files"], json.loads((tiny_bundle / "manifest.json").read_text())["files"]
    for graph in ("text_encoder.onnx", "vae_decoder.onnx", "vae_encoder.onnx"):
        assert ours[graph]["sha256"] == theirs[graph]["sha256"], f"{graph} is the base checkpoint's"


def test_comfyui_names_and_bf16_weights_load(finetune, tiny_checkpoint, tmp_path):
    """ComfyUI's whole-model file: the transformer's keys under `model.diffusion_model.`, the VAE's
    beside them (not the transformer's), bfloat16 weights (cast to float32)."""
    weights, bfl = finetune
    comfy = tmp_path / "comfy.safetensors"
    tensors = {f"model.diffusion_model.{k}": v.to(torch.bfloat16) for k, v in load_file(str(bfl)).items()}
    save_file({**tensors, "vae.decoder.conv_in.weight": torch.zeros(4, 4)}, str(comfy))
    checkpoint = Checkpoint(tiny_checkpoint, comfy)
    checkpoint.check_weights()
    loaded = checkpoint.load_transformer().state_dict()
    for key, weight in weights.items():
        assert loaded[key].dtype == torch.float32
        assert torch.equal(loaded[key], weight.to(torch.bfloat16).float()), key


def test_diffusers_names_are_taken_as_they_are(finetune, tiny_checkpoint, tmp_path):
    """A transformer saved by diffusers (`save_pretrained`'s names) as one file: no renaming (the
    converter's substring renames would break `...modulation_img.linear`)."""
    weights, _ = finetune
    path = tmp_path / "diffusers.safetensors"
    save_file({k: v.half() for k, v in weights.items()}, str(path))
    checkpoint = Checkpoint(tiny_checkpoint, path)
    checkpoint.check_weights()
    loaded = checkpoint.load_transformer().state_dict()
    assert all(torch.equal(loaded[k], v.half().float()) for k, v in weights.items())


def test_files_that_are_no_flux2_transformer_are_refused(finetune, tiny_checkpoint, tmp_path, capsys):
    _, bfl = finetune
    bfl_weights = load_file(str(bfl))
    cases = {
        "float8.safetensors": (
            {k: v.to(torch.float8_e4m3fn) for k, v in bfl_weights.items()},
            "are F8_E4M3: --transformer takes float32, float16 or bfloat16 weights",
        ),
        "other_model.safetensors": ({"foo.weight": torch.zeros(2, 2)}, "lack 49 of the model's weights"),
        "wider.safetensors": (
            {**bfl_weights, "img_in.weight": torch.zeros(96, 128)},
            "x_embedder.weight is [96, 128], config.json gives [64, 128]",
        ),
    }
    for name, (tensors, _) in cases.items():
        save_file(tensors, str(tmp_path / name))
    (tmp_path / "text.safetensors").write_text("not safetensors")
    cases["text.safetensors"] = (None, "not a readable safetensors file")
    cases["missing.safetensors"] = (None, "no such file")
    (tmp_path / "folder").mkdir()
    cases["folder"] = (None, "a directory; --transformer takes one .safetensors file")
    pair = {"transformer.x_embedder.lora_A.weight": torch.zeros(2, 128)}
    pair["transformer.x_embedder.lora_B.weight"] = torch.zeros(64, 2)
    save_file(pair, str(tmp_path / "lora.safetensors"))
    cases["lora.safetensors"] = (None, "a LoRA (its keys are LoRA factors), not a transformer's weights: give it")
    for name, (_, needle) in cases.items():
        path, out = tmp_path / name, tmp_path / "out"
        code = main(["convert", "--checkpoint", str(tiny_checkpoint), "--transformer", str(path), "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and f"{path}: " in err and needle in err, err
        assert "Traceback" not in err and not out.exists()


def test_verify_takes_the_same_file(finetune, exported, tiny_checkpoint, capsys):
    """verify compares the bundle with diffusers running the file's transformer; without the file
    (against the checkpoint's own transformer) it is refused before any work, naming the file."""
    verify = ["verify", "--checkpoint", str(tiny_checkpoint), "--bundle", str(exported), "--images-only"]
    assert main(verify) == 2
    err = capsys.readouterr().err
    assert "its transformer was exported from finetune.safetensors" in err and "--transformer FILE" in err, err
    assert main([*verify, "--transformer", str(finetune[1])]) == 0
    assert "passed: 0 case(s) past tolerance" in capsys.readouterr().out


def test_the_checkpoint_needs_only_its_transformer_config(finetune, tiny_checkpoint, tmp_path):
    """With a single-file transformer, the checkpoint's own transformer weights are never read: a
    checkpoint without them (the 4B's are 8 GB) is enough."""
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_checkpoint, checkpoint)
    for weights in (checkpoint / "transformer").glob("*.safetensors"):
        weights.unlink()
    Checkpoint(checkpoint, finetune[1]).check_weights()


def test_lora_map_leaves_the_map_convert_wrote(exported, tiny_checkpoint, capsys):
    assert main(["lora-map", "--checkpoint", str(tiny_checkpoint), "--bundle", str(exported)]) == 2
    assert "exported from finetune.safetensors (convert --transformer)" in capsys.readouterr().err


def test_bundles_of_other_weights_are_not_compared(exported, tiny_bundle):
    """`verify --against` compares a bundle with its own fp32 export: the base's is refused, naming
    the transformer file that sets them apart."""
    with pytest.raises(BundleError, match="model.transformer_file"):
        check_same_model(exported, tiny_bundle)
