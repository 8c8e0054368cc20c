#!/usr/bin/env bash
# Runs every test from a fresh clone with no manual step: installs the ONNX Runtime library and the
# pinned Python environment (.venv, once), then the Rust tests (which build the release binary) and
# the Python tests (export tool, and the runtime end to end against diffusers; the Python bindings
# and the serving tests).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
KLEIN_ORT_DYLIB="$(scripts/setup-ort.sh)"
export KLEIN_ORT_DYLIB
source scripts/python-env.sh
# The build first: the C API test links the example against the cdylib this produces.
cargo build --release
# The Python bindings (python/, the distribution klein-runtime): built and installed into .venv for
# tests/python with plain pip, as users install it (pip runs maturin; the build reuses target/).
python -m pip install --quiet --force-reinstall --no-deps ./python
cargo test --release
# Lints: clippy (the lints lib.rs sets, and clippy's defaults) on every target of the workspace
# (the library, the CLI, the Python bindings, tests, benches, examples), and rustfmt.
cargo clippy --release --workspace --all-targets --quiet -- -D warnings
cargo fmt --all --check
# The library alone (what the C library, the wheel and Rust embedders link) depends on none of the
# binary's crates: they come with the `cli` feature only.
binary_only='^(clap|anyhow|indicatif|ctrlc|axum|tokio|hyper|hyper-util) '
if cargo tree -p klein --no-default-features -e normal --prefix none | grep -E "$binary_only"; then
    echo "test.sh: the library without the cli feature depends on the crates above" >&2
    exit 1
fi
cargo check --release --features cuda
cargo check --release --features coreml
# The library's documentation, as an embedder reads it: no broken or private links.
RUSTDOCFLAGS="-D warnings" cargo doc --release --no-deps --quiet
ruff check export
ruff format --check export
ruff check --config export/pyproject.toml python tests/python deploy benches
ruff format --config export/pyproject.toml --check python tests/python deploy benches
# The web page's tests (tests/python/test_web.py) drive Debian's Chromium with Playwright (a pip
# package of export[test]); Playwright's own browser download needs a host we cannot reach.
if ! command -v chromium >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "test.sh: installing Debian's chromium for the web page's tests" >&2
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "test.sh: the web page's tests need Chromium on PATH: install it (Debian, Ubuntu: sudo apt-get install chromium)" >&2
        exit 1
    fi
fi
# The Python tests: the export tool's (export/tests) and the runtime's from Python (tests/python: the
# bindings, the server, the web page, Ray). Three processes, a test file each at a time (its module
# fixtures built once): most of the time is exporting tiny checkpoints, single-threaded Python, and a
# third process keeps both cores of a 2-core host busy while one waits (for a convert another
# process holds the export cache's lock on, for a server, for Ray).
# Their fixtures' converts share an export cache (export/tests/conftest.py), emptied here: the two
# processes, and the int8 run below, copy the components exported once.
rm -rf target/test-export-cache
python -m pytest -q -n 3 --dist loadfile --durations=15 export/tests tests/python
# The int8 checks again as on a CPU without VNNI (AVX2 only: AMD Zen 1-3, Intel before Ice Lake),
# whatever this host has: ONNX Runtime, the Python bindings and the CLI are run from copies whose CPUID
# answers "AVX2, no VNNI" (benches/avx2-host.sh, patched mode; the Rust side is tests/it/avx2_host.rs).
# There ONNX Runtime's u8 x s8 products saturate unless the weights are converted to uint8, as the
# runtime and the export tool do (export/klein_export/int8_kernels.py). No faulthandler: the mask
# answers SIGILL, which Python's handler would take first.
# On a host that has neither AVX-512 nor VNNI (AMD Zen 1-3, Intel before Skylake-X) the mask changes
# nothing, and the run above was that run already.
if grep -qwE 'avx512f|avx512_vnni|avx_vnni' /proc/cpuinfo; then
    AVX2_HOST_MODE=patched benches/avx2-host.sh python -m pytest -q -p no:faulthandler -n 2 --dist loadfile \
        -m int8_kernels export/tests tests/python/test_int8_cpu.py
else
    echo "test.sh: this CPU has no AVX-512 and no VNNI: the int8 tests above ran on AVX2 kernels already" >&2
fi
