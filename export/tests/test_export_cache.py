"""`convert --cache DIR` (export_cache.py): a convert of what the cache holds copies it, byte for byte;
a changed transformer is exported again while the text encoder and VAE are copied; an entry left
half-written is exported again."""

import shutil

import numpy as np
from safetensors.numpy import load_file, save_file

from klein_export.checkpoint import Checkpoint
from klein_export.cli import main
from klein_export.convert import convert
from klein_export.export_cache import ENTRIES, component_key


def _files(bundle):
    return {p.name: p.read_bytes() for p in bundle.iterdir()}


def test_a_cached_convert_is_the_same_bundle(tiny_checkpoint, tiny_bundle, tmp_path, export_cache):
    # tiny_bundle was converted through the cache: every component is in it now.
    lines = []
    again = convert(tiny_checkpoint, tmp_path / "klein-tiny", variant="tiny", log=lines.append, cache=export_cache)
    taken = [line for line in lines if "from the export cache" in line]
    assert len(taken) == 3 and not [line for line in lines if line.startswith("exported ")], lines
    assert _files(again) == _files(tiny_bundle)


def test_a_changed_transformer_is_exported_and_the_rest_copied(tiny_checkpoint, tiny_bundle, tmp_path, export_cache):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    weights = ckpt / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    name = "transformer_blocks.0.attn.to_q.weight"
    tensors[name] = (tensors[name] * np.float32(1.5)).astype(tensors[name].dtype)
    save_file(tensors, weights)
    lines = []
    bundle = convert(ckpt, tmp_path / "klein-tiny", variant="tiny", log=lines.append, cache=export_cache)
    assert [line.split()[1] for line in lines if "from the export cache" in line] == ["text_encoder", "vae"], lines
    assert [line.split()[1] for line in lines if line.startswith("exported ")] == ["transformer"], lines
    changed, before = _files(bundle), _files(tiny_bundle)
    assert changed["text_encoder.onnx"] == before["text_encoder.onnx"]
    assert changed["vae_decoder.onnx"] == before["vae_decoder.onnx"]
    assert changed["transformer.onnx"] != before["transformer.onnx"]


def test_a_half_written_entry_is_exported_again(tiny_checkpoint, tiny_bundle, tmp_path, export_cache, capsys):
    cache = tmp_path / "cache"
    shutil.copytree(export_cache, cache, ignore=shutil.ignore_patterns("*.lock"))
    key = component_key(Checkpoint(tiny_checkpoint), "vae", "fp32", (), True)
    (cache / key / ENTRIES).unlink()
    out = tmp_path / "klein-tiny"
    assert (
        main(
            [
                "convert",
                "--checkpoint",
                str(tiny_checkpoint),
                "--out",
                str(out),
                "--variant",
                "tiny",
                "--cache",
                str(cache),
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "took text_encoder (fp32) from the export cache" in err and "exported vae (fp32)" in err, err
    assert _files(out) == _files(tiny_bundle)
    assert (cache / key / ENTRIES).is_file()
