"""Fixtures of the Python tests (bindings, Ray Serve): the repository, the `klein` CLI that
scripts/test.sh builds, and the bundled tiny model."""

from pathlib import Path

import pytest

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
