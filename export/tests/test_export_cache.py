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


def test_what_changed_or_was_half_written_is_exported_and_the_rest_copied(
    tiny_checkpoint, tiny_bundle, tmp_path, export_cache, capsys
):
    """One convert through a copy of the cache: the transformer's weights changed (exported again),
    the VAE's entry half-written (exported again), the text encoder unchanged (copied)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    weights = ckpt / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    name = "transformer_blocks.0.attn.to_q.weight"
    tensors[name] = (tensors[name] * np.float32(1.5)).astype(tensors[name].dtype)
    save_file(tensors, weights)
    cache = tmp_path / "cache"
    shutil.copytree(export_cache, cache, ignore=shutil.ignore_patterns("*.lock"))
    vae = component_key(Checkpoint(ckpt), "vae", "fp32", (), True)
    (cache / vae / ENTRIES).unlink()
    out = tmp_path / "klein-tiny"
    argv = ["convert", "--checkpoint", str(ckpt), "--out", str(out), "--variant", "tiny", "--cache", str(cache)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "took text_encoder (fp32) from the export cache" in err, err
    assert "exported transformer (fp32)" in err and "exported vae (fp32)" in err, err
    changed, before = _files(out), _files(tiny_bundle)
    assert changed["text_encoder.onnx"] == before["text_encoder.onnx"]
    assert changed["vae_decoder.onnx"] == before["vae_decoder.onnx"]  # exported again: the same bytes
    assert changed["transformer.onnx"] != before["transformer.onnx"]
    assert (cache / vae / ENTRIES).is_file()
