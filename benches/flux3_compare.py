"""klein against diffusers' FLUX.3 modular pipeline on one FLUX.3 checkpoint, in one run.

Each repetition of each side is a fresh process (klein: the `klein` binary; diffusers: this script
re-invoked with `--worker`), interleaved (klein, diffusers, klein, ...), with the same prompt, seed,
size, steps and thread count. Reported per side: the median wall time of the process (spawn to
exit: what a user waits for, imports and loads included), the median of klein's own "generate"
time (`--timings`: the sum of its stages) and of diffusers' `from_pretrained` + pipeline call, peak
resident memory (`ru_maxrss` from `os.wait4`), and the PSNR of klein's image against diffusers'.

Usage (repository root, in the export venv; klein built with `cargo build --release`):

    klein-export tiny --preset flux3-wide --out /tmp/flux3-wide
    klein-export convert --checkpoint /tmp/flux3-wide --out /tmp/flux3-wide-bundle
    python benches/flux3_compare.py --checkpoint /tmp/flux3-wide --bundle /tmp/flux3-wide-bundle \\
        --size 512 --reps 3 --threads 2
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

PROMPT = "a lighthouse on a cliff at dawn, watercolour"


def _worker(args):
    import torch

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    from klein_export.flux3_reference import load_reference, run_reference

    pipe = load_reference(args.checkpoint)
    image = run_reference(
        pipe,
        PROMPT,
        args.seed,
        args.size,
        args.size,
        steps=args.steps,
        output_type="pil",
    )[0]
    seconds = time.perf_counter() - start
    image.save(args.out)
    print(json.dumps({"generate": seconds}))


def _run(cmd, env=None):
    start = time.perf_counter()
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    out, err = process.stdout.read(), process.stderr.read()
    if status != 0:
        raise RuntimeError(f"{cmd[0]} failed ({status}): {err[-2000:]}")
    return wall, usage.ru_maxrss / 1024, out, err


def _klein_generate_seconds(stderr):
    """The sum of klein's stage times (`--timings` lines `name: 1.234 s`)."""
    return sum(float(m) for m in re.findall(r"^\s*[a-zA-Z ]+:\s+([\d.]+) s$", stderr, re.MULTILINE))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--bundle")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--klein", default="target/release/klein")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return _worker(args)
    steps = args.steps or json.loads((Path(args.bundle) / "manifest.json").read_text())["model"]["default_steps"]
    work = Path(tempfile.mkdtemp(prefix="flux3-compare-"))
    runs = {"klein": [], "diffusers": []}
    for rep in range(args.reps):
        out = work / f"klein-{rep}.png"
        cmd = [
            args.klein,
            "generate",
            PROMPT,
            "--model",
            args.bundle,
            "--seed",
            str(args.seed),
            "--steps",
            str(steps),
        ]
        cmd += [
            "--width",
            str(args.size),
            "--height",
            str(args.size),
            "--threads",
            str(args.threads),
            "--timings",
        ]
        wall, rss, _, err = _run(cmd + ["-o", str(out), "--no-verify-hashes"])
        runs["klein"].append(
            {
                "wall": wall,
                "rss": rss,
                "generate": _klein_generate_seconds(err),
                "image": out,
            }
        )
        out = work / f"diffusers-{rep}.png"
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "--checkpoint",
            args.checkpoint,
            "--size",
            str(args.size),
        ]
        cmd += [
            "--steps",
            str(steps),
            "--seed",
            str(args.seed),
            "--threads",
            str(args.threads),
            "--out",
            str(out),
        ]
        wall, rss, stdout, _ = _run(cmd)
        generate = json.loads(stdout.strip().splitlines()[-1])["generate"]
        runs["diffusers"].append({"wall": wall, "rss": rss, "generate": generate, "image": out})
    med = {
        side: {k: statistics.median(r[k] for r in rs) for k in ("wall", "rss", "generate")} for side, rs in runs.items()
    }
    a = np.asarray(Image.open(runs["klein"][0]["image"]).convert("RGB"), np.float64)
    b = np.asarray(Image.open(runs["diffusers"][0]["image"]).convert("RGB"), np.float64)
    mse = np.mean((a - b) ** 2)
    psnr = float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)
    print(f"{args.size}x{args.size}, {steps} steps, {args.threads} threads, medians of {args.reps} (work dir {work})")
    print(f"{'':10s} {'wall s':>8s} {'generate s':>11s} {'peak RSS MB':>12s}")
    for side in ("klein", "diffusers"):
        m = med[side]
        print(f"{side:10s} {m['wall']:8.1f} {m['generate']:11.1f} {m['rss']:12.0f}")
    k, d = med["klein"], med["diffusers"]
    print(
        f"diffusers / klein: wall {d['wall'] / k['wall']:.2f}x, generate {d['generate'] / k['generate']:.2f}x, "
        f"memory {d['rss'] / k['rss']:.2f}x; klein vs diffusers image {psnr:.1f} dB"
    )


if __name__ == "__main__":
    main()
