#!/usr/bin/env bash
# Builds the CPU path of flux2.c (github.com/antirez/flux2.c, now iris.c), the C implementation of
# FLUX.2-klein, for benches/flux2c.py: `make blas` (OpenBLAS, its fastest CPU build), after installing
# OpenBLAS from Debian (libopenblas-dev) when its header is missing.
#
# Usage: benches/flux2c-build.sh FLUX2C_SOURCE_DIR     (a checkout; the binary is FLUX2C_SOURCE_DIR/flux)
set -euo pipefail

src=${1:?usage: benches/flux2c-build.sh FLUX2C_SOURCE_DIR}
[ -f "$src/Makefile" ] && [ -f "$src/flux.c" ] || { echo "$src: not a flux2.c checkout (no Makefile, flux.c)" >&2; exit 2; }

if [ ! -e /usr/include/openblas/cblas.h ]; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get install -y --no-install-recommends libopenblas-dev ||
        { $sudo apt-get update -qq && $sudo apt-get install -y --no-install-recommends libopenblas-dev; }
fi
make -C "$src" blas
"$src/flux" -h 2>&1 | sed -n 1p
