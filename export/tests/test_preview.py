"""The step-preview map (klein_export/preview.py): written by `convert`, added to an older bundle by
`klein-export preview` (the same map: the fit is deterministic), and better than no map: on its
images it reproduces the colours with a lower error than the images' mean colour does."""

import shutil

import numpy as np
import torch

from klein_export.checkpoint import Checkpoint
from klein_export.cli import main
from klein_export.manifest import read_manifest, write_manifest
from klein_export.preview import _images, fit_preview
from klein_export.tiny import build_tiny


def test_convert_writes_the_map_and_preview_adds_the_same(tiny_checkpoint, tiny_bundle, tmp_path):
    preview = read_manifest(tiny_bundle)["preview"]
    assert len(preview["weights"]) == 128 and all(len(row) == 3 for row in preview["weights"])
    assert len(preview["bias"]) == 4
    old = tmp_path / "old"
    shutil.copytree(tiny_bundle, old)
    manifest = read_manifest(old)
    del manifest["preview"]
    write_manifest(manifest, old)
    # Another checkpoint of the same size (another seed): refused, the manifest left as it was.
    other = build_tiny(tmp_path / "other", seed=1)
    assert main(["preview", "--checkpoint", str(other), "--bundle", str(old)]) == 2
    assert "preview" not in read_manifest(old)
    assert main(["preview", "--checkpoint", str(tiny_checkpoint), "--bundle", str(old)]) == 0
    assert read_manifest(old)["preview"] == preview


def test_the_map_explains_the_colours(tiny_checkpoint):
    preview = fit_preview(Checkpoint(tiny_checkpoint).load_vae())
    colours = torch.nn.functional.avg_pool2d((_images(24, 256) + 1) / 2, 8).numpy()
    baseline = float(np.sqrt(np.mean((colours - colours.mean(axis=(0, 2, 3), keepdims=True)) ** 2)))
    print(f"fit RMSE {preview['fit_rmse']} against {baseline:.4f} for the mean colour")
    assert preview["fit_rmse"] < 0.9 * baseline
