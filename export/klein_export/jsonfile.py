"""Reading the JSON files of checkpoints and bundles, with errors that name the file."""

import json
from pathlib import Path


def read_json(path: Path, error: type, missing: str) -> dict:
    """The parsed file; `error` naming it when it is missing (with the reason `missing`) or not JSON."""
    if not path.is_file():
        raise error(f"{path}: missing ({missing})")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from e
