#!/usr/bin/env bash
# Runs every test from a fresh clone with no manual step: installs the ONNX Runtime library and the
# pinned Python environment (.venv, once), then the Rust tests (which build the release binary) and
# the Python tests (export tool, and the runtime end to end against diffusers).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
KLEIN_ORT_DYLIB="$(scripts/setup-ort.sh)"
export KLEIN_ORT_DYLIB
source scripts/python-env.sh
# The build first: the C API test links the example against the cdylib this produces.
cargo build --release
cargo test --release
cargo check --release --features cuda,coreml
ruff check export
ruff format --check export
python -m pytest -q export/tests
