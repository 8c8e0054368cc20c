#!/usr/bin/env bash
# Regenerates the committed tiny model and the diffusers fixtures from scratch:
#   onnx/klein-tiny/                  the bundle (the runtime's embedded default)
#   tests/fixtures/diffusers/<case>/  diffusers' Flux2KleinPipeline outputs on the same checkpoint
# The checkpoint itself (seeded, reproducible) is written to target/klein-tiny-checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python-env.sh
ckpt=target/klein-tiny-checkpoint
rm -rf "$ckpt"
klein-export tiny --out "$ckpt" --seed 0
klein-export convert --checkpoint "$ckpt" --out onnx/klein-tiny --variant tiny --name klein-tiny --force
klein-export verify --checkpoint "$ckpt" --bundle onnx/klein-tiny
klein-export fixtures --checkpoint "$ckpt" --out tests/fixtures/diffusers --force
