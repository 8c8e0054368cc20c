#!/usr/bin/env bash
# Installs the ONNX Runtime shared library that klein loads at run time into <repo>/.ort/.
#
# The library comes from the official `onnxruntime` wheel on PyPI (it ships
# onnxruntime/capi/libonnxruntime.so.X.Y.Z on Linux, libonnxruntime.X.Y.Z.dylib on macOS), fetched
# with pip and unpacked with Python's zipfile: nothing is downloaded when klein runs.
# Idempotent: does nothing when the library is already there.
#
# Prints the absolute path of the library on stdout (messages go to stderr), so a build script can do
#   export KLEIN_ORT_DYLIB="$(scripts/setup-ort.sh)"
#   cargo build
# and bake the path into the binary (see src/runtime/mod.rs for the full search order).
set -euo pipefail

# Keep in step with the `api-31` feature of `ort` in Cargo.toml: ort refuses an older library.
ORT_VERSION="1.31.1"
# Every onnxruntime wheel carries the same library; asking for one Python version lets any python3
# that can run pip fetch it.
WHEEL_PYTHON="3.11"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$repo/.ort"

case "$(uname -s)" in
    Linux) lib_name="libonnxruntime.so.$ORT_VERSION" ;;
    Darwin) lib_name="libonnxruntime.$ORT_VERSION.dylib" ;;
    *)
        echo "setup-ort.sh: unsupported OS $(uname -s); set ORT_DYLIB_PATH to an ONNX Runtime $ORT_VERSION library instead" >&2
        exit 1
        ;;
esac

if [[ -f "$dest/$lib_name" ]]; then
    echo "setup-ort.sh: ONNX Runtime $ORT_VERSION already installed" >&2
    echo "$dest/$lib_name"
    exit 0
fi

tmp="$(mktemp -d)"
mkdir -p "$dest"
# Staged inside .ort/ so that the final moves are renames on one file system: an interrupted run
# never leaves a half-written library under its real name.
stage="$(mktemp -d "$dest/.stage.XXXXXX")"
trap 'rm -rf "$tmp" "$stage"' EXIT

echo "setup-ort.sh: fetching onnxruntime==$ORT_VERSION with pip" >&2
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$WHEEL_PYTHON" \
    --dest "$tmp" "onnxruntime==$ORT_VERSION" >&2

shopt -s nullglob
wheels=("$tmp"/onnxruntime-"$ORT_VERSION"-*.whl)
if [[ ${#wheels[@]} -ne 1 ]]; then
    echo "setup-ort.sh: expected one onnxruntime wheel in $tmp, found ${#wheels[@]}" >&2
    exit 1
fi

# Unpack only onnxruntime/capi/libonnxruntime* (flat) into the staging folder.
python3 - "${wheels[0]}" "$stage" <<'PY'
import os, sys, zipfile

wheel, stage = sys.argv[1], sys.argv[2]
prefix = "onnxruntime/capi/libonnxruntime"
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.startswith(prefix)]
    if not members:
        sys.exit(f"setup-ort.sh: no {prefix}* in {wheel}")
    for m in members:
        with z.open(m) as src, open(os.path.join(stage, os.path.basename(m)), "wb") as dst:
            dst.write(src.read())
PY

if [[ ! -f "$stage/$lib_name" ]]; then
    echo "setup-ort.sh: the wheel has no $lib_name (found: $(ls "$stage"))" >&2
    exit 1
fi
# The main library last: its presence is what marks the install as complete.
for f in "$stage"/*; do
    [[ "$f" == "$stage/$lib_name" ]] || mv -f "$f" "$dest/"
done
mv -f "$stage/$lib_name" "$dest/$lib_name"

echo "setup-ort.sh: installed $dest/$lib_name" >&2
echo "$dest/$lib_name"
