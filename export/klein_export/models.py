"""Installed models: bundles in klein's models folder, each named by its folder (`klein-export pull`
writes them; the runtime's `--model NAME` and `klein models` read them; src/bundle/installed.rs is
the runtime's side of the same rules).

The folder is `$KLEIN_MODELS_DIR`, else `$XDG_DATA_HOME/klein/models`, else
`$HOME/.local/share/klein/models`, else `%LOCALAPPDATA%\\klein\\models`."""

import os
import re
from pathlib import Path

from .errors import KleinExportError

_PART = re.compile(r"^[A-Za-z0-9_.-]+$")


def models_dir() -> Path | None:
    def var(name):
        value = os.environ.get(name)
        return Path(value) if value else None

    if folder := var("KLEIN_MODELS_DIR"):
        return folder
    for name, tail in (("XDG_DATA_HOME", ("klein", "models")), ("HOME", (".local", "share", "klein", "models"))):
        if folder := var(name):
            return folder.joinpath(*tail)
    if folder := var("LOCALAPPDATA"):
        return folder / "klein" / "models"
    return None


def default_name(repo_id: str) -> str | None:
    """The repository's name in lower case (`black-forest-labs/FLUX.2-klein-4B` -> `flux.2-klein-4b`),
    as the runtime resolves a Hub id to an installed model."""
    org, slash, name = repo_id.partition("/")
    parts_ok = all(p not in ("", ".", "..") and _PART.match(p) for p in (org, name))
    return name.lower() if slash and parts_ok else None


def check_name(name: str) -> str:
    if name in ("", ".", "..") or not _PART.match(name):
        raise KleinExportError(
            f"--name {name!r}: a model's name is a folder name of letters, digits, '.', '_' and '-' "
            "(it is what --model takes)"
        )
    return name
