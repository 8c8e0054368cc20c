"""The KV variant's reason to exist, measured: the seconds of each denoising step with references,
for a plain bundle and a KV bundle of one architecture, from `klein generate --timings`.

    python benches/kv_steps.py --plain /work/big/wide-fused --kv /work/big/wide-kv \
        --size 512 --refs 1 --reps 3 --threads 2

Each bundle runs in its own `klein` process (the bundles alternating per repetition), one
generation of `--steps` steps per repetition, with `--refs` references of the output's size. Prints
every step's seconds and, per bundle, the median first step and the median of the later steps.
A plain bundle's steps all carry the reference tokens; a KV bundle's first step extracts their
K/V and its later steps take the cache instead.
"""

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS_LINE = re.compile(r"denoise steps: (.*) s$")


def reference(path: Path, side: int, seed: int):
    sys.path.insert(0, str(REPO / "export"))
    from klein_export.fixtures import synthetic_image

    synthetic_image(side, side, "RGB", seed=seed).save(path)


def steps_of(bundle, size, refs, steps, threads, seed):
    cmd = [str(REPO / "target" / "release" / "klein"), "generate", "a red boat on a lake", "--model", str(bundle)]
    cmd += ["--width", str(size), "--height", str(size), "--steps", str(steps), "--seed", str(seed)]
    cmd += ["--threads", str(threads), "--timings", "--quiet", "-o", str(Path(tempfile.gettempdir()) / "kv_steps.png")]
    for path in refs:
        cmd += ["--ref", str(path)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"{bundle}: klein failed ({run.returncode}): {run.stderr.strip()[-500:]}")
    lines = [STEPS_LINE.search(line) for line in run.stderr.splitlines()]
    found = [m for m in lines if m]
    if not found:
        raise SystemExit(f"{bundle}: no 'denoise steps' line in:\n{run.stderr}")
    return [float(x) for x in found[-1].group(1).split(", ")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plain", required=True, help="a plain bundle")
    parser.add_argument("--kv", required=True, help="a KV bundle of the same architecture")
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--refs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        refs = [Path(tmp) / f"ref{i}.png" for i in range(args.refs)]
        for i, path in enumerate(refs):
            reference(path, args.size, seed=i)
        runs = {"plain": [], "kv": []}
        for rep in range(args.reps):
            for name in runs:
                seconds = steps_of(getattr(args, name), args.size, refs, args.steps, args.threads, seed=rep)
                runs[name].append(seconds)
                print(f"{name} rep {rep + 1}: steps {', '.join(f'{s:.2f}' for s in seconds)} s", flush=True)
    print(f"\n{args.size}x{args.size}, {args.refs} reference(s), {args.threads} threads, median of {args.reps}:")
    medians = {}
    for name, reps in runs.items():
        first = statistics.median(r[0] for r in reps)
        later = statistics.median(s for r in reps for s in r[1:])
        medians[name] = (first, later)
        print(f"  {name:6} first step {first:7.2f} s   later steps {later:7.2f} s")
    print(f"  KV later step / plain step: {medians['kv'][1] / medians['plain'][1]:.2f}")
    print(f"  KV first step / plain step: {medians['kv'][0] / medians['plain'][1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
