import pytest

from klein_export.convert import convert
from klein_export.tiny import build_tiny


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("ckpt") / "klein-tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_bundle(tiny_checkpoint, tmp_path_factory):
    return convert(
        tiny_checkpoint, tmp_path_factory.mktemp("bundle") / "klein-tiny", variant="tiny", log=lambda _: None
    )
