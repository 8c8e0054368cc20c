"""Reading the JSON files of checkpoints and bundles, with errors that name the file."""

import json
from pathlib import Path


def read_json(path: Path, error: type, missing: str) -> dict:
    """The parsed file, a JSON object; `error` naming it when it is missing (with the reason
    `missing`), not JSON or not an object."""
    if not path.is_file():
        raise error(f"{path}: missing ({missing})")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise error(f"{path}: a JSON object ({{...}}) is expected, not {type(value).__name__}")
    return value
