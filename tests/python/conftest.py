"""Fixtures of the Python tests (bindings, Ray Serve): the repository, the `klein` CLI that
scripts/test.sh builds, the bundled tiny model and a LoRA for it."""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[2]


def pytest_configure(config: pytest.Config) -> None:
    # As in export/pyproject.toml: scripts/test.sh selects these for its run under avx2-host.sh.
    config.addinivalue_line(
        "markers", "int8_kernels: runs ONNX Runtime's u8 x s8 int8 kernels (run again under benches/avx2-host.sh)"
    )


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def klein_bin(repo: Path) -> Path:
    """The release CLI (`cargo build --release`, as scripts/test.sh does first); under
    benches/avx2-host.sh in its patched mode, the masked copy it made of it."""
    masked = os.environ.get("KLEIN_AVX2_HOST_BIN")
    path = Path(masked) if masked else repo / "target" / "release" / "klein"
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `cargo build --release` (scripts/test.sh does)")
    return path


@pytest.fixture(scope="session")
def tiny_bundle(repo: Path) -> Path:
    """The bundled tiny model: 64x64 images, 4 steps."""
    return repo / "onnx" / "klein-tiny"


@dataclass(frozen=True)
class InpaintInputs:
    """An inpainting source (100x72, so the output is 96x64) and one mask in both conventions:
    `white` repaints its white box (klein, diffusers), `transparent` its transparent box (OpenAI)."""

    source: Image.Image
    white: Image.Image
    transparent: Image.Image


@pytest.fixture
def inpaint_inputs() -> InpaintInputs:
    source = Image.linear_gradient("L").resize((100, 72)).convert("RGB")
    white = Image.new("RGB", (50, 36), "black")
    white.paste((255, 255, 255), (10, 5, 40, 30))
    transparent = Image.new("RGBA", (50, 36), (9, 9, 9, 255))
    transparent.paste((0, 0, 0, 0), (10, 5, 40, 30))
    return InpaintInputs(source, white, transparent)


@pytest.fixture(scope="session")
def tiny_lora(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`style.safetensors`: a diffusers-layout LoRA of rank 2 on every linear layer of the tiny
    model's transformer (the layers and shapes of its manifest's LoRA map)."""
    from safetensors.numpy import save_file

    manifest = json.loads((tiny_bundle / "manifest.json").read_text())
    rng = np.random.default_rng(5)
    tensors = {}
    for module, target in manifest["graphs"]["transformer"]["lora_targets"].items():
        out, inp = target["shape"]
        tensors[f"transformer.{module}.lora_A.weight"] = rng.uniform(-0.3, 0.3, (2, inp)).astype(np.float32)
        tensors[f"transformer.{module}.lora_B.weight"] = rng.uniform(-0.3, 0.3, (out, 2)).astype(np.float32)
    path = tmp_path_factory.mktemp("loras") / "style.safetensors"
    save_file(tensors, str(path))
    return path
