"""A bundle whose transformer keeps its weights in external data, as every full-size fp32 and fp16
bundle does (the 4B transformer is 15.5 GB in float32): a LoRA merged at load time is written to a
scratch copy of the graph, and must give the same image with the CPU cache as without it (the
cache's entry of the bundle's own graph once came back in its place, the LoRA silently dropped)."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
from PIL import Image
from test_bad_bundles import _external, _restamp

import onnx


def _external_transformer(tiny_bundle: Path, bundle: Path) -> None:
    """A copy of the tiny bundle with the transformer's weights of 1 KiB or more in
    `transformer.onnx.data`, and its LoRA map pointing at them there (as the exporter writes it)."""
    shutil.copytree(tiny_bundle, bundle)
    graph = bundle / "transformer.onnx"
    names = _external(onnx.load(graph), graph, 1024)
    offsets = {
        tensor.name: int({e.key: e.value for e in tensor.external_data}["offset"])
        for tensor in onnx.load(graph, load_external_data=False).graph.initializer
        if tensor.external_data
    }
    manifest = json.loads((bundle / "manifest.json").read_text())
    for target in manifest["graphs"]["transformer"]["lora_targets"].values():
        target["file"], target["offset"] = names[1], offsets[target["initializer"]]
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2))
    _restamp(bundle, names)


def test_a_lora_on_external_weights_is_applied_with_the_cpu_cache(tiny_bundle, tiny_lora, klein_bin, tmp_path):
    bundle = tmp_path / "bundle"
    _external_transformer(tiny_bundle, bundle)
    env = {**os.environ, "KLEIN_CACHE_DIR": str(tmp_path / "cache")}

    def pixels(name: str, *extra) -> np.ndarray:
        out = tmp_path / f"{name}.png"
        size = ["--width", "64", "--height", "64", "--steps", "2", "--seed", "1"]
        args = ["generate", "a cat", "-m", bundle, *size, "-o", out]
        run = subprocess.run([klein_bin, *args, *extra], capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 0, run.stderr
        return np.asarray(Image.open(out))

    cache = ["--cpu-cache", tmp_path / "cpu-cache"]
    lora = ["--lora", tiny_lora]
    plain = pixels("plain", *cache)  # fills the cache with the bundle's own graphs
    with_lora = pixels("lora", *lora)
    assert np.abs(with_lora.astype(int) - plain).max() > 10, "the LoRA changes the image"
    np.testing.assert_array_equal(pixels("lora-cached", *lora, *cache), with_lora)
    np.testing.assert_array_equal(pixels("plain-cached", *cache), plain)
    assert not list((tmp_path / "cpu-cache").glob("*.partial-*"))
