"""The export cache (convert's `cache`, export_cache.py) the fixtures' converts share: across the two
test processes, and across scripts/test.sh's runs (it empties it first). Tests of the export itself
convert without it. A module of its own, not conftest's: a run that collects export/tests and
tests/python together imports only one `conftest`."""

import os
from pathlib import Path

EXPORT_CACHE = Path(
    os.environ.get("KLEIN_TEST_EXPORT_CACHE", Path(__file__).resolve().parents[2] / "target" / "test-export-cache")
)
