"""`klein-export fixtures` writes its directory whole or not at all, and refuses an existing one
without --force."""

import pytest

from klein_export.errors import OutputExistsError
from klein_export.fixtures import CASES, write_fixtures

SMALL = ({**CASES[0], "width": 32, "height": 32, "steps": 1},)


def test_writes_every_case(tiny_checkpoint, tmp_path):
    out = tmp_path / "fixtures"
    write_fixtures(tiny_checkpoint, out, cases=SMALL, log=lambda _: None)
    assert sorted(p.name for p in (out / SMALL[0]["name"]).iterdir()) == ["case.json", "tensors.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["fixtures"]  # no temporary directory left


def test_refuses_an_existing_directory(tiny_checkpoint, tmp_path):
    out = tmp_path / "fixtures"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(OutputExistsError, match="--force"):
        write_fixtures(tiny_checkpoint, out, cases=SMALL, log=lambda _: None)
    with pytest.raises(OutputExistsError, match="holds something else"):  # not a fixtures directory
        write_fixtures(tiny_checkpoint, out, cases=SMALL, force=True, log=lambda _: None)
    assert (out / "mine.txt").read_text() == "keep"


def test_a_failing_case_leaves_the_old_directory(tiny_checkpoint, tmp_path):
    out = tmp_path / "fixtures"
    (out / "old").mkdir(parents=True)
    (out / "old" / "case.json").write_text("{}")  # a case of an earlier run: --force may replace it
    broken = {**SMALL[0], "name": "broken", "refs": [(32, 32, "RGB", {"format": "TIFF"})]}  # no such fixture format
    with pytest.raises(KeyError, match="TIFF"):
        write_fixtures(tiny_checkpoint, out, cases=(*SMALL, broken), force=True, log=lambda _: None)
    assert [p.name for p in out.iterdir()] == ["old"]
    assert [p.name for p in tmp_path.iterdir()] == ["fixtures"]
