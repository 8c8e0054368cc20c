"""`klein-export` on malformed inputs: each case exits 2 with one line naming the file or the
option and what is valid, no traceback, and nothing written. Cheap cases only (no export runs)."""

import json
import shutil

import pytest

from klein_export.cli import main
from klein_export.manifest import file_entry


def _run(args, capsys) -> str:
    """`main(args)`'s stderr; the exit code must be 2 and no traceback printed."""
    code = main([str(a) for a in args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "klein-export: error: " in err, err
    return err


@pytest.fixture
def bundle_copy(tiny_bundle, tmp_path):
    """A copy of the tiny bundle's manifest and graphs structure (its files, as the tools read them)."""
    dst = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, dst)
    return dst


@pytest.mark.parametrize(
    "text, needle",
    [("[]", "a JSON object ({...}) is expected, not list"), ("{}", "no model, graphs, latents section")],
)
def test_a_manifest_of_the_wrong_shape_is_named(bundle_copy, tmp_path, capsys, text, needle):
    (bundle_copy / "manifest.json").write_text(text)
    for args in (
        ["quantize", "--bundle", bundle_copy, "--out", tmp_path / "q", "--quantize", "int8"],
        ["verify", "--bundle", bundle_copy, "--against", bundle_copy, "--no-images"],
    ):
        err = _run(args, capsys)
        assert f"{bundle_copy / 'manifest.json'}: {needle}" in err
    assert not (tmp_path / "q").exists()


def test_a_manifest_without_a_graph_is_named(bundle_copy, tmp_path, capsys):
    manifest = json.loads((bundle_copy / "manifest.json").read_text())
    del manifest["graphs"]["transformer"]
    (bundle_copy / "manifest.json").write_text(json.dumps(manifest))
    err = _run(["quantize", "--bundle", bundle_copy, "--out", tmp_path / "q", "--quantize", "int8"], capsys)
    assert f"{bundle_copy / 'manifest.json'}: graphs has no transformer" in err
    assert not (tmp_path / "q").exists()


def test_a_model_index_of_the_wrong_shape_is_named(tiny_checkpoint, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    (ckpt / "model_index.json").write_text("[]")
    err = _run(["convert", "--checkpoint", ckpt, "--out", tmp_path / "out"], capsys)
    assert f"{ckpt / 'model_index.json'}: a JSON object" in err
    index = json.loads((tiny_checkpoint / "model_index.json").read_text())
    index["transformer"] = ["diffusers"]  # not [library, class]
    (ckpt / "model_index.json").write_text(json.dumps(index))
    err = _run(["convert", "--checkpoint", ckpt, "--out", tmp_path / "out"], capsys)
    assert "component 'transformer' is None" in err
    assert not (tmp_path / "out").exists()


def test_a_corrupt_or_missing_graph_is_named(tiny_checkpoint, bundle_copy, tmp_path, capsys):
    graph = bundle_copy / "transformer.onnx"
    graph.write_text("not a graph")
    err = _run(["lora-map", "--checkpoint", tiny_checkpoint, "--bundle", bundle_copy], capsys)
    assert f"{graph}: not a readable ONNX graph" in err
    err = _run(["quantize", "--bundle", bundle_copy, "--out", tmp_path / "q", "--quantize", "int4"], capsys)
    assert f"{graph}: not a readable ONNX graph" in err
    graph.unlink()
    err = _run(["quantize", "--bundle", bundle_copy, "--out", tmp_path / "q", "--quantize", "int4"], capsys)
    assert f"{graph}: missing" in err  # the input's file, not the temporary copy's
    assert not (tmp_path / "q").exists()


def test_files_changed_since_the_export_are_named(tiny_checkpoint, tiny_bundle, bundle_copy, tmp_path, capsys):
    """A graph swapped for another or a deleted tokenizer: named by quantize (not copied and listed
    with new hashes) and by verify (not a traceback from ONNX Runtime), as input or as reference."""
    commands = [
        ["quantize", "--bundle", bundle_copy, "--out", tmp_path / "q", "--quantize", "int8"],
        ["verify", "--bundle", bundle_copy, "--checkpoint", tiny_checkpoint, "--no-images"],
        ["verify", "--bundle", bundle_copy, "--against", tiny_bundle, "--no-images"],
        ["verify", "--bundle", tiny_bundle, "--against", bundle_copy, "--no-images"],
    ]
    graph = bundle_copy / "transformer.onnx"
    shutil.copyfile(bundle_copy / "vae_decoder.onnx", graph)
    for args in commands:
        err = _run(args, capsys)
        assert f"{graph}: " in err and "manifest.json lists: replaced or modified since the export" in err, err
    shutil.copyfile(tiny_bundle / "transformer.onnx", graph)
    (bundle_copy / "tokenizer.json").unlink()
    for args in commands:
        err = _run(args, capsys)
        assert f"{bundle_copy / 'tokenizer.json'}: missing (listed in manifest.json)" in err, err
    assert not (tmp_path / "q").exists()


def test_a_graph_that_does_not_match_its_manifest_is_named(tiny_checkpoint, tiny_bundle, bundle_copy, capsys):
    """A graph swapped for another together with its listed hashes (the files check passes): verify
    names the graph and each tensor that differs, not an ONNX Runtime error when it runs."""
    graph = bundle_copy / "transformer.onnx"
    shutil.copyfile(bundle_copy / "vae_decoder.onnx", graph)
    path = bundle_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"]["transformer.onnx"] = file_entry(graph)
    path.write_text(json.dumps(manifest))
    for reference in (["--checkpoint", tiny_checkpoint], ["--against", tiny_bundle]):
        err = _run(["verify", "--bundle", bundle_copy, *reference, "--no-images"], capsys)
        assert f"{graph}: the graph does not match manifest.json (" in err, err
        latents = "input latents: manifest.json lists tensor(float) of rank 3, the graph has tensor(float) of rank 4"
        assert latents in err, err
        assert "input timestep: manifest.json lists tensor(float) of rank 1, the graph has none" in err, err


def test_quantize_copies_only_the_files_of_the_bundle(bundle_copy, tmp_path, capsys):
    """A file the manifest does not list (a user's notes, an image) is left out of the quantized
    copy, said so, and not listed in its manifest with a hash."""
    (bundle_copy / "notes.txt").write_text("mine")
    (bundle_copy / "previews").mkdir()
    out = tmp_path / "q"
    args = ["quantize", "--bundle", bundle_copy, "--out", out, "--quantize", "int8", "--components", "transformer"]
    assert main([str(a) for a in args]) == 0
    assert "not copied (the manifest does not list them): notes.txt, previews" in capsys.readouterr().out
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert sorted(p.name for p in out.iterdir()) == sorted([*files, "manifest.json"])
    assert "notes.txt" not in files and (bundle_copy / "notes.txt").exists()


def test_verify_refuses_a_static_shape_bundle(tiny_checkpoint, tiny_bundle, bundle_copy, capsys):
    """Its graphs take batch 1 at its buckets only: refused, naming what verify runs (it failed in
    ONNX Runtime, or passed at a --size that happened to be the first bucket's)."""
    path = bundle_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["static_shapes"] = {"batch": 1, "seq": 512, "refs": 0, "buckets": [{"width": 64, "height": 64}]}
    path.write_text(json.dumps(manifest))
    for reference in (["--checkpoint", tiny_checkpoint], ["--against", tiny_bundle, "--size", "64"]):
        err = _run(["verify", "--bundle", bundle_copy, *reference], capsys)
        assert f"{bundle_copy}: a static-shape bundle" in err and "verifies bundles with dynamic shapes" in err, err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--checkpoint", "c", "--against", "r"], "argument --against: not allowed with argument --checkpoint"),
        (["--against", "r", "--images-only", "--no-images"], "--no-images: not allowed with argument --images-only"),
    ],
)
def test_verify_options_that_exclude_each_other_are_refused_by_the_parser(args, needle, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["verify", "--bundle", "b", *args])
    assert exit.value.code == 2
    assert needle in capsys.readouterr().err


def test_an_output_that_holds_the_checkpoint_is_refused(tiny_checkpoint, tmp_path, capsys):
    ckpt = tmp_path / "models" / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    for out in (ckpt, ckpt.parent):
        err = _run(["convert", "--checkpoint", ckpt, "--out", out, "--force"], capsys)
        assert "would replace the checkpoint" in err
    assert (ckpt / "model_index.json").is_file()


def test_force_replaces_only_what_the_command_writes(tiny_checkpoint, bundle_copy, tmp_path, capsys):
    """--force deletes the old --out: never a folder holding the input, a user's folder, or a file;
    each refused before any work, with everything left in place."""
    quantize = ["quantize", "--bundle", bundle_copy, "--quantize", "int8", "--force", "--out"]
    err = _run(quantize + [bundle_copy.parent], capsys)
    assert "would replace the input bundle" in err
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    err = _run(quantize + [mine], capsys)
    assert "--force replaces only what this command writes" in err
    afile = tmp_path / "afile"
    afile.write_text("")
    err = _run(quantize + [afile], capsys)
    assert f"{afile}: is a file, not a directory" in err
    err = _run(quantize + [afile / "sub"], capsys)
    assert f"{afile} is a file, not a directory" in err
    err = _run(["fixtures", "--checkpoint", tiny_checkpoint, "--out", tiny_checkpoint.parent, "--force"], capsys)
    assert "would replace the checkpoint" in err
    assert (mine / "notes.txt").read_text() == "keep me" and (bundle_copy / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "bundle", "mine"]


@pytest.mark.parametrize("size", ["8", "24", "512"])
def test_a_block_size_onnx_runtime_cannot_quantize_is_refused(bundle_copy, tmp_path, capsys, size):
    quantize = ["quantize", "--bundle", bundle_copy, "--out", tmp_path / "q", "--quantize", "int4"]
    err = _run(quantize + ["--block-size", size], capsys)
    assert f"--block-size {size}: MatMulNBits takes 16, 32, 64, 128, 256" in err
    assert not (tmp_path / "q").exists()


def test_an_empty_or_half_lora_and_too_many_loras_are_refused(tiny_checkpoint, tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    empty, half = tmp_path / "empty.safetensors", tmp_path / "half.safetensors"
    save_file({}, empty)
    save_file({"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 64)}, half)
    convert = ["convert", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "out", "--lora"]
    assert f"{empty}: the file holds no LoRA weights" in _run(convert + [empty], capsys)
    err = _run(convert + [half], capsys)
    assert f"{half}: transformer_blocks.0.attn.to_q has only one of lora_A and lora_B" in err
    many = [a for _ in range(17) for a in ("--lora", empty)]
    assert "17 LoRAs: at most 16" in _run(convert[:-1] + many, capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.safetensors", "half.safetensors"]


def test_what_diffusers_would_drop_or_unpickle_is_refused(tiny_checkpoint, tmp_path, capsys):
    """As the runtime refuses them, before any export: a pickled LoRA (diffusers would unpickle it,
    running its code), text-encoder keys and DoRA magnitudes (diffusers drops them and merges the
    rest), non-finite values (the bundle would make black images)."""
    import torch
    from safetensors.torch import save_file

    pair = {
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(4, 64),
        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(64, 4),
    }
    pickled = tmp_path / "style.pt"
    torch.save(pair, pickled)
    text_encoder = tmp_path / "te.safetensors"
    save_file({**pair, "lora_te1_model_layers_0_self_attn_q_proj.lora_down.weight": torch.ones(4, 8)}, text_encoder)
    dora = tmp_path / "dora.safetensors"
    save_file({**pair, "transformer.transformer_blocks.0.attn.to_q.lora_magnitude_vector": torch.ones(64)}, dora)
    nan = tmp_path / "nan.safetensors"
    save_file({**pair, next(iter(pair)): torch.full((4, 64), float("nan"))}, nan)
    convert = ["convert", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "out", "--lora"]
    for lora, needle in [
        (pickled, "not a safetensors file"),
        (text_encoder, "1 text-encoder keys (lora_te1_model_layers_0_self_attn_q_proj.lora_down.weight)"),
        (dora, "a DoRA adapter (transformer.transformer_blocks.0.attn.to_q.lora_magnitude_vector)"),
        (nan, "transformer.transformer_blocks.0.attn.to_q.lora_A.weight holds non-finite values"),
    ]:
        assert f"{lora}: {needle}" in _run(convert + [lora], capsys)
    assert not (tmp_path / "out").exists()


def test_a_lora_that_is_no_safetensors_or_has_a_bad_scale_is_named(tiny_checkpoint, tmp_path, capsys):
    lora = tmp_path / "style.safetensors"
    lora.write_text("plain text")
    err = _run(["convert", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "out", "--lora", lora], capsys)
    assert f"{lora}: not a safetensors file" in err
    err = _run(["convert", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "out", "--lora", f"{lora}:abc"], capsys)
    assert "the LoRA scale `abc` is not a number" in err
    # Python's digit separators are no number to the runtime (`1_0` was read as 10).
    err = _run(["convert", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "out", "--lora", f"{lora}:1_0"], capsys)
    assert "the LoRA scale `1_0` is not a number" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["ranges", "--checkpoint", "x", "--steps", "0"],
        ["ranges", "--checkpoint", "x", "--size", "7"],
        ["ranges", "--checkpoint", "x", "--size", "32"],  # diffusers makes no image under 64 px
        ["verify", "--bundle", "x", "--size", "0"],
        ["tiny", "--out", "x", "--seed", str(2**64)],
    ],
)
def test_numbers_out_of_range_are_refused_by_the_parser(args, capsys):
    with pytest.raises(SystemExit) as exit:
        main(args)
    assert exit.value.code == 2
    assert "give" in capsys.readouterr().err


def test_an_output_under_a_file_is_an_error_not_a_traceback(tmp_path, capsys):
    (tmp_path / "afile").write_text("")
    err = _run(["tiny", "--out", tmp_path / "afile" / "sub"], capsys)
    assert f"{tmp_path / 'afile'} is a file, not a directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.parametrize("command", ["convert", "ranges"])
def test_truncated_weights_are_named_before_any_export(tiny_checkpoint, tmp_path, capsys, command):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    weights = next((ckpt / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    out = tmp_path / "out"
    args = [command, "--checkpoint", ckpt] + (["--out", out] if command == "convert" else [])
    err = _run(args, capsys)
    assert f"{weights}: not a readable safetensors file" in err
    assert not out.exists()


@pytest.mark.parametrize("command", ["convert", "ranges"])
def test_weights_the_files_lack_are_named_not_made_up(tiny_checkpoint, tmp_path, capsys, command):
    """A whole safetensors file (its header passes) without the model's tensors: diffusers would
    leave them without data (a crash later), transformers would make them up at random."""
    import torch
    from safetensors.torch import save_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    weights = next((ckpt / "transformer").glob("*.safetensors"))
    save_file({"not.a.weight": torch.zeros(3)}, weights)
    out = tmp_path / "out"
    args = [command, "--checkpoint", ckpt] + (["--out", out] if command == "convert" else [])
    err = _run(args, capsys)
    assert f"{ckpt / 'transformer'}: its safetensors files lack" in err
    assert not out.exists()


def test_lora_factors_the_runtime_cannot_read_are_refused_before_any_export(tiny_checkpoint, tmp_path, capsys):
    """Integer or float64 weights, ranks that differ within a pair, factors that are not 2-D, a
    norm's factors: each refused as the runtime refuses it, from the file alone (no export starts)."""
    import torch
    from safetensors.torch import save_file

    a, b = (f"transformer.transformer_blocks.0.attn.to_q.lora_{x}.weight" for x in "AB")
    cases = {
        "int": ({a: torch.ones(4, 64, dtype=torch.int32), b: torch.ones(64, 4, dtype=torch.int32)}, "are I32"),
        "f64": ({a: torch.ones(4, 64, dtype=torch.float64), b: torch.ones(64, 4, dtype=torch.float64)}, "are F64"),
        "ranks": ({a: torch.ones(4, 64), b: torch.ones(64, 3)}, "their ranks (4 and 3) differ"),
        "three_d": ({a: torch.ones(4, 64, 1), b: torch.ones(64, 4, 1)}, "factors are 2-D"),
        "norm": (
            {
                "transformer.transformer_blocks.0.attn.norm_q.lora_A.weight": torch.ones(4, 32),
                "transformer.transformer_blocks.0.attn.norm_q.lora_B.weight": torch.ones(32, 4),
            },
            "match no linear layer",
        ),
    }
    convert = ["convert", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "out", "--lora"]
    for name, (tensors, needle) in cases.items():
        lora = tmp_path / f"{name}.safetensors"
        save_file(tensors, lora)
        err = _run(convert + [lora], capsys)
        assert f"{lora}: " in err and needle in err, err
        assert "text_encoder" not in err  # refused before the first export
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "config, key, value, needle",
    [
        ("text_encoder", "num_hidden_layers", "28", 'num_hidden_layers is "28"; it must be a positive whole number'),
        ("transformer", "num_attention_heads", 2.5, "num_attention_heads is 2.5"),
        ("vae", "block_out_channels", 32, "block_out_channels is 32; it must be a list of positive whole numbers"),
        ("transformer", "axes_dims_rope", [8, 8], "axes_dims_rope [8, 8] sums to 16, but attention_head_dim is 32"),
        # Numbers the models compute with: each failed with a traceback, some minutes into the export.
        ("transformer", "rope_theta", "abc", 'rope_theta is "abc"; it must be a finite positive number'),
        ("transformer", "eps", float("inf"), "eps is Infinity; it must be a finite positive number"),
        ("transformer", "mlp_ratio", True, "mlp_ratio is true; it must be a finite positive number"),
        ("transformer", "guidance_embeds", "no", 'guidance_embeds is "no"; it must be true or false'),
        ("text_encoder", "rope_theta", "abc", 'rope_theta is "abc"; it must be a finite positive number'),
        ("text_encoder", "rope_parameters", {"rope_theta": "abc"}, 'rope_parameters.rope_theta is "abc"; it must be'),
        ("text_encoder", "rms_norm_eps", "x", 'rms_norm_eps is "x"; it must be a finite positive number'),
        ("vae", "batch_norm_eps", "x", 'batch_norm_eps is "x"; it must be a finite positive number'),
        ("vae", "sample_size", "x", 'sample_size is "x"; it must be a positive whole number or a list of them'),
        # Values no check names, that the library cannot build a model from.
        ("vae", "act_fn", "nope", "the library cannot build the vae from it (ValueError: activation function nope"),
        ("text_encoder", "layer_types", 5, "the library cannot build the text_encoder from it (TypeError"),
        # Another model's class with this model's sizes (its weights would load): still refused.
        (
            "transformer",
            "_class_name",
            "FluxTransformer2DModel",
            "_class_name is 'FluxTransformer2DModel', but model_index.json gives 'Flux2Transformer2DModel'",
        ),
        ("vae", "_class_name", "AutoencoderKL", "_class_name is 'AutoencoderKL', but model_index.json gives"),
    ],
)
def test_a_config_value_of_the_wrong_type_is_named(tiny_checkpoint, tmp_path, capsys, config, key, value, needle):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    path = ckpt / config / "config.json"
    data = json.loads(path.read_text())
    data[key] = value
    path.write_text(json.dumps(data))
    err = _run(["convert", "--checkpoint", ckpt, "--out", tmp_path / "out"], capsys)
    assert f"{path}: {needle}" in err, err
    assert not (tmp_path / "out").exists()


def test_an_output_inside_the_input_or_unwritable_is_refused(bundle_copy, tmp_path, capsys):
    err = _run(["quantize", "--bundle", bundle_copy, "--out", bundle_copy / "q", "--quantize", "int8"], capsys)
    assert "would be written inside the input bundle" in err, err
    assert not (bundle_copy / "q").exists()
    assert sorted(p.name for p in bundle_copy.iterdir() if p.name.startswith(".")) == []
    err = _run(["quantize", "--bundle", bundle_copy, "--out", "/proc/klein-q", "--quantize", "int8"], capsys)
    assert "/proc/klein-q: cannot write in /proc" in err, err


def test_a_graph_entry_of_the_wrong_shape_is_named(bundle_copy, tmp_path, capsys):
    path = bundle_copy / "manifest.json"
    original = json.loads(path.read_text())
    for graphs, needle in [
        ({"transformer": "transformer.onnx"}, "graphs.transformer must be an object with a `file` name"),
        ({"transformer": {**original["graphs"]["transformer"], "quantization": {}}}, "graphs.transformer.quantization"),
    ]:
        path.write_text(json.dumps({**original, "graphs": {**original["graphs"], **graphs}}))
        err = _run(["quantize", "--bundle", bundle_copy, "--out", tmp_path / "q", "--quantize", "int8"], capsys)
        assert f"{path}: {needle}" in err, err
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize(
    "file, key, value, needle",
    [
        ("model_index.json", "is_distilled", "no", "is_distilled is 'no'; true or false"),
        ("scheduler/scheduler_config.json", "num_train_timesteps", 0, "num_train_timesteps is 0; a whole number"),
        ("scheduler/scheduler_config.json", "shift", "abc", "shift is 'abc'; a positive number"),
    ],
)
def test_pipeline_settings_of_the_wrong_type_are_named(tiny_checkpoint, tmp_path, capsys, file, key, value, needle):
    """Settings the manifest copies (a string read as true, numbers the runtime would refuse later
    without naming this file): refused here, naming the file."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    path = ckpt / file
    data = json.loads(path.read_text())
    data[key] = value
    path.write_text(json.dumps(data))
    err = _run(["convert", "--checkpoint", ckpt, "--out", tmp_path / "out"], capsys)
    shown = ckpt / "model_index.json" if file == "model_index.json" else path
    assert f"{shown}: {needle}" in err, err
    assert not (tmp_path / "out").exists()


def test_a_lora_whose_merge_overflows_is_refused(tiny_checkpoint, tmp_path, capsys, export_cache):
    """Factors and a scale each within bounds whose merge is not finite (kohya's alpha 1e30 over
    float16 factors): refused, not exported as NaN and infinite weights."""
    import torch
    from safetensors.torch import save_file

    base = "lora_unet_double_blocks_0_img_attn_qkv"
    lora = tmp_path / "alpha.safetensors"
    save_file(
        {
            f"{base}.lora_down.weight": torch.full((4, 64), 0.1, dtype=torch.float16),
            f"{base}.lora_up.weight": torch.full((192, 4), 0.1, dtype=torch.float16),
            f"{base}.alpha": torch.tensor(1e30),
        },
        lora,
    )
    convert = ["convert", "--checkpoint", tiny_checkpoint, "--out", tmp_path / "out", "--cache", export_cache]
    err = _run([*convert, "--lora", lora], capsys)
    assert f"{lora}: merged into the transformer" in err and "non-finite values" in err, err
    assert not (tmp_path / "out").exists()
