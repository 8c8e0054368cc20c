#!/usr/bin/env bash
# Runs a command as if this x86-64 host had AVX2 and FMA only (no AVX-512, AVX-VNNI or AMX), so that
# the libraries in it pick the kernels an AVX2-only host would (benches/avx2_host.c says how). For
# issue 15 target 7 on an AVX-512 host, e.g.
#   benches/avx2-host.sh .venv/bin/python benches/compare.py --checkpoint CKPT ...
# Two ways, by what the host allows:
# - with `cpuid_fault` in /proc/cpuinfo: every `cpuid` instruction of the command and its children
#   is answered masked (torch, ONNX Runtime, klein, everything);
# - without it (or with AVX2_HOST_MODE=patched): copies made here of ONNX Runtime's library
#   (ORT_DYLIB_PATH, else .ort/), of the .venv's onnxruntime and klein_runtime (bindings) Python packages
#   and of target/release/klein (each where it exists) have their `cpuid` instructions turned into `ud2`
#   (benches/avx2_patch.py) and are answered masked; ORT_DYLIB_PATH, PYTHONPATH and
#   KLEIN_AVX2_HOST_BIN point at them (compare.py runs that klein; any other program of ours must be
#   such a copy, in a directory named avx2-host). torch is held to its AVX2 kernels by its own
#   settings (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS).
# The core, clocks and memory stay the host's: the figures show which kernels win on AVX2, not what
# an older CPU would time.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)
out="$root/target/avx2-host"
lib="$out/libavx2_host.so"
if [ ! -e "$lib" ] || [ "$here/avx2_host.c" -nt "$lib" ]; then
    mkdir -p "$out"
    cc -O2 -shared -fPIC -Wall -Wextra -Werror -o "$lib" "$here/avx2_host.c"
fi

# A patched copy of $1 at $2, made again when $1 is newer.
patched() {
    [ -e "$1" ] || { echo "avx2-host: $1 does not exist (needed for its masked copy)" >&2; exit 2; }
    if [ ! -e "$2" ] || [ "$1" -nt "$2" ]; then
        python3 "$here/avx2_patch.py" "$1" "$2"
    fi
}

if [ "${AVX2_HOST_MODE:-}" = patched ] || ! grep -qw cpuid_fault /proc/cpuinfo; then
    ort="${ORT_DYLIB_PATH:-$(ls "$root"/.ort/libonnxruntime.so.* 2>/dev/null | head -n 1)}"
    [ -n "$ort" ] || { echo "avx2-host: no ONNX Runtime library (set ORT_DYLIB_PATH or run scripts/setup-ort.sh)" >&2; exit 2; }
    patched "$ort" "$out/ort/$(basename "$ort")"
    export ORT_DYLIB_PATH="$out/ort/$(basename "$ort")"
    pkg=$(ls -d "$root"/.venv/lib/python3*/site-packages/onnxruntime 2>/dev/null | head -n 1)
    if [ -n "$pkg" ]; then
        mkdir -p "$out/python"
        tar -C "$(dirname "$pkg")" --exclude 'onnxruntime_pybind11_state*.so' -cf - onnxruntime | tar -C "$out/python" -xf -
        for so in "$pkg"/capi/onnxruntime_pybind11_state*.so; do
            patched "$so" "$out/python/onnxruntime/capi/$(basename "$so")"
        done
    fi
    # The Python bindings (klein_runtime._klein, installed by scripts/test.sh): their runtime reads CPUID too.
    bindings=$(ls -d "$root"/.venv/lib/python3*/site-packages/klein_runtime 2>/dev/null | head -n 1)
    if [ -n "$bindings" ] && ls "$bindings"/_klein*.so >/dev/null 2>&1; then
        mkdir -p "$out/python"
        tar -C "$(dirname "$bindings")" --exclude '_klein*.so' -cf - klein_runtime | tar -C "$out/python" -xf -
        for so in "$bindings"/_klein*.so; do
            patched "$so" "$out/python/klein_runtime/$(basename "$so")"
        done
    fi
    [ ! -d "$out/python" ] || export PYTHONPATH="$out/python${PYTHONPATH:+:$PYTHONPATH}"
    if [ -e "$root/target/release/klein" ]; then
        patched "$root/target/release/klein" "$out/bin/klein"
        export KLEIN_AVX2_HOST_BIN="$out/bin/klein"
    fi
    export AVX2_HOST_PATCHED=1
    export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
fi
# glibc chose its string functions before the library loads; the tunables keep them AVX2 as well.
export GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX512F,-AVX512VL,-AVX512BW,-AVX512DQ,-AVX512CD,-AVX_VNNI,-AMX_TILE
export LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}"
export KLEIN_BENCH_ISA_MASK=avx2
exec "$@"
