#!/usr/bin/env bash
# Runs a command as if this x86-64 host had AVX2 and FMA only (no AVX-512, AVX-VNNI or AMX): every
# library in it and in its children picks its AVX2 kernels (benches/avx2_host.c says how; needs
# `cpuid_fault` in /proc/cpuinfo). For issue 15 target 7 on an AVX-512 host, e.g.
#   benches/avx2-host.sh .venv/bin/python benches/compare.py --checkpoint CKPT ...
# The core, clocks and memory stay the host's: the figures show which kernels win on AVX2, not what
# an older CPU would time.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
grep -qw cpuid_fault /proc/cpuinfo || { echo "avx2-host: this kernel or CPU has no CPUID faulting (cpuid_fault)" >&2; exit 2; }
lib="$here/../target/avx2-host/libavx2_host.so"
if [ ! -e "$lib" ] || [ "$here/avx2_host.c" -nt "$lib" ]; then
    mkdir -p "$(dirname "$lib")"
    cc -O2 -shared -fPIC -Wall -Wextra -Werror -o "$lib" "$here/avx2_host.c"
fi
# glibc chose its string functions before the library loads; the tunables keep them AVX2 as well.
export GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX512F,-AVX512VL,-AVX512BW,-AVX512DQ,-AVX512CD,-AVX_VNNI,-AMX_TILE
export LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}"
export KLEIN_BENCH_ISA_MASK=avx2
exec "$@"
