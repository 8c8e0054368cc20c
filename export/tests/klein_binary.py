"""The klein CLI the tests run: the release binary (`cargo build --release`, as scripts/test.sh does
first); under benches/avx2-host.sh in its patched mode, the masked copy it made of it
($KLEIN_AVX2_HOST_BIN). The unmasked binary would read the real CPUID (VNNI) while loading the
masked ONNX Runtime (no VNNI kernels), and so leave 8-bit codes unconverted where they saturate.
A module of its own, not conftest's (see export_cache_dir.py)."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KLEIN = Path(os.environ.get("KLEIN_AVX2_HOST_BIN") or REPO / "target" / "release" / "klein")
