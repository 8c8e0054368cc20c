"""Fixtures of the Python tests (bindings, Ray Serve): the repository, the `klein` CLI that
scripts/test.sh builds, and the bundled tiny model."""

from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def klein_bin(repo: Path) -> Path:
    """The release CLI (`cargo build --release`, as scripts/test.sh does first)."""
    path = repo / "target" / "release" / "klein"
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
