#!/usr/bin/env bash
# Are this checkout's images, byte for byte, those of another revision? For changes that must not
# change behaviour (a refactor): builds REV's `klein` in a git worktree under target/same-images/,
# runs the same `klein generate` commands with both binaries on the bundled tiny model, and compares
# every file they write (images, previews, numbered outputs).
#
#   scripts/same-images.sh [REV]        # REV defaults to HEAD (the last commit)
#
# Cases: text to image (PNG, WebP, two images with previews), edit, compose, inpaint, img2img, mask
# crop, LoRA. The other front ends are held to the CLI's files within one build by the tests:
# the C API (tests/it/capi.rs), Python and `klein serve` (tests/python/). Exit 0 when every file is
# equal, 1 when one differs (named), 2 for a usage error.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
rev=${1:-HEAD}
sha=$(git rev-parse --verify --quiet "$rev^{commit}") || { echo "same-images.sh: $rev is not a revision" >&2; exit 2; }

KLEIN_ORT_DYLIB="$(scripts/setup-ort.sh)"
export KLEIN_ORT_DYLIB
source scripts/python-env.sh

work="$root/target/same-images"
mkdir -p "$work"
tree="$work/tree-$sha"
if [ ! -d "$tree" ]; then
    git worktree add --detach --quiet "$tree" "$sha"
fi
echo "same-images.sh: building $rev ($sha) and this checkout" >&2
(cd "$tree" && CARGO_TARGET_DIR="$work/target" cargo build --release --quiet --bin klein)
cargo build --release --quiet --bin klein
theirs="$work/target/release/klein"
ours="$root/target/release/klein"

# Inputs: the reference fixtures, a mask at the source's size, and a LoRA on every layer of the
# bundle's LoRA map (fixed seeds: the same files every run).
inputs="$work/inputs"
mkdir -p "$inputs"
refs="$root/tests/fixtures/reference"
bundle="$root/onnx/klein-tiny"
python - "$inputs" "$bundle" <<'PY'
import json, sys
from pathlib import Path

import numpy as np
from PIL import Image
from safetensors.numpy import save_file

inputs, bundle = Path(sys.argv[1]), Path(sys.argv[2])
mask = Image.new("L", (150, 110), 0)
mask.paste(255, (40, 30, 100, 80))
mask.save(inputs / "mask.png")
rng = np.random.default_rng(5)
tensors = {}
for module, target in json.loads((bundle / "manifest.json").read_text())["graphs"]["transformer"]["lora_targets"].items():
    out, inp = target["shape"]
    tensors[f"transformer.{module}.lora_A.weight"] = rng.uniform(-0.3, 0.3, (2, inp)).astype(np.float32)
    tensors[f"transformer.{module}.lora_B.weight"] = rng.uniform(-0.3, 0.3, (out, 2)).astype(np.float32)
save_file(tensors, str(inputs / "style.safetensors"))
PY

# name | arguments after `klein generate PROMPT --model BUNDLE -q`; the output file is NAME.png
# unless the arguments name one.
cases=(
    "t2i|--seed 7 --width 64 --height 48"
    "t2i-webp|--seed 8 --width 48 --height 64 -o OUT/t2i-webp.webp"
    "two-with-previews|--seed 9 --width 64 --height 64 --num-images 2 --preview OUT/preview.png --preview-every 2"
    "edit|--seed 10 --ref $refs/rgba.png"
    "compose|--seed 11 --ref $refs/wide.png --ref $refs/orient6.jpg --ref $refs/palette.png"
    "inpaint|--seed 12 --image $refs/large.png --mask $inputs/mask.png --strength 0.75"
    "img2img|--seed 13 --image $refs/orient8.webp --strength 0.5"
    "mask-crop|--seed 14 --image $refs/large.png --mask $inputs/mask.png --mask-crop 8"
    "lora|--seed 15 --width 64 --height 64 --lora $inputs/style.safetensors:0.8"
)

differ=0
for side in theirs ours; do rm -rf "$work/out-$side"; mkdir -p "$work/out-$side"; done
for case in "${cases[@]}"; do
    name=${case%%|*}
    args=${case#*|}
    for side in theirs ours; do
        bin=$theirs; [ "$side" = ours ] && bin=$ours
        out="$work/out-$side"
        # shellcheck disable=SC2086 # the arguments are words
        set -- ${args//OUT/$out}
        [[ " $* " == *" -o "* ]] || set -- "$@" -o "$out/$name.png"
        "$bin" generate "a lighthouse on a cliff, $name" --model "$bundle" -q "$@" >/dev/null
    done
done
for file in "$work/out-theirs"/*; do
    other="$work/out-ours/$(basename "$file")"
    if [ ! -e "$other" ]; then
        echo "same-images.sh: $(basename "$file"): written by $rev only" >&2; differ=1
    elif ! cmp -s "$file" "$other"; then
        echo "same-images.sh: $(basename "$file"): differs" >&2; differ=1
    fi
done
for file in "$work/out-ours"/*; do
    [ -e "$work/out-theirs/$(basename "$file")" ] || { echo "same-images.sh: $(basename "$file"): written by this checkout only" >&2; differ=1; }
done
count=$(ls "$work/out-ours" | wc -l)
if [ "$differ" = 0 ]; then
    echo "same-images.sh: all $count files equal to $rev's ($sha)"
fi
exit "$differ"
