#!/usr/bin/env bash
# What a LoRA adds to loading: `klein generate` on BUNDLE with and without `--lora LORA`,
# alternating, REPS times each (default 3), at 256x256 with 1 step and 2 threads. Prints each run's
# stage load times and peak RSS (/usr/bin/time -v); the logs stay in OUT (default a temporary
# directory). Add `--prompt-cache DIR` after the arguments (EXTRA...) to leave the text encoder out
# of the runs after the first, so that the peak is the transformer's.
#   benches/lora_load.sh BUNDLE LORA [REPS] [EXTRA...]
set -euo pipefail
bundle="$1"; lora="$2"; reps="${3:-3}"; shift $(( $# < 3 ? $# : 3 ))
klein="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/release/klein"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"
for rep in $(seq "$reps"); do
  for mode in plain lora; do
    extra=()
    [[ $mode == lora ]] && extra=(--lora "$lora")
    log="$out/$mode-$rep.log"
    /usr/bin/time -v "$klein" generate "a raccoon astronaut" --model "$bundle" --width 256 --height 256 \
      --steps 1 --seed 1 --threads 2 --timings -o "$out/$mode.png" "${extra[@]}" "$@" > "$log" 2>&1
    echo "$mode $rep: $(grep -E 'load (text encoder|transformer|VAE decoder)|Maximum resident' "$log" \
      | sed -E 's/^[[:space:]]+//' | tr -s ' ' | paste -sd ';')"
  done
done
