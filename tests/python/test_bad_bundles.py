"""Bundles whose hashes agree with their manifest but whose graph ONNX Runtime refuses for a reason
of its own (an opset it does not support, external data out of bounds, shape constants it cannot
read from external data): the CLI's answer is that of any bad bundle, exit code 2 naming the file,
and no output file."""

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

import onnx


def _restamp(bundle: Path, names: list[str]) -> None:
    """The manifest's sizes and sha256s of `names` set to the files' own, as an exporter would."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    for name in names:
        data = (bundle / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=2))


def _opset_99(model: onnx.ModelProto, path: Path) -> list[str]:
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = 99
    onnx.save_model(model, path)
    return [path.name]


def _external(model: onnx.ModelProto, path: Path, threshold: int) -> list[str]:
    onnx.save_model(
        model,
        path,
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=f"{path.name}.data",
        size_threshold=threshold,
    )
    return [path.name, f"{path.name}.data"]


def _truncated_data(model: onnx.ModelProto, path: Path) -> list[str]:
    names = _external(model, path, 1024)
    data = path.with_name(names[1])
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    return names


BREAKS = {
    "opset 99": _opset_99,
    "external data cut in half": _truncated_data,
    "shape constants in external data": lambda model, path: _external(model, path, 0),
}


@pytest.mark.parametrize("name", BREAKS)
def test_a_graph_onnx_runtime_refuses_is_a_bad_bundle(name, tiny_bundle, klein_bin, tmp_path):
    bundle = tmp_path / "bundle"
    shutil.copytree(tiny_bundle, bundle)
    graph = bundle / "vae_decoder.onnx"
    model = onnx.load(graph)
    graph.unlink()
    _restamp(bundle, BREAKS[name](model, graph))
    out = tmp_path / "out.png"
    env = {**os.environ, "KLEIN_CACHE_DIR": str(tmp_path / "cache")}
    run = subprocess.run(
        [klein_bin, "generate", "a cat", "-m", bundle, "--width", "64", "--height", "64", "--steps", "1", "-o", out],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr
    assert "vae_decoder.onnx" in run.stderr and "cannot read it as the vae_decoder graph" in run.stderr, run.stderr
    assert "panicked" not in run.stderr
    assert not out.exists()
