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
    klein-export quantize --bundle /tmp/flux3-wide-bundle --out /tmp/flux3-wide-dd --quantize int8 --method dynamic
    klein-export quantize --bundle /tmp/flux3-wide-dd --out /tmp/flux3-wide-dds --quantize int8 --method static
    python benches/flux3_compare.py --checkpoint /tmp/flux3-wide --bundle /tmp/flux3-wide-bundle \\
        --extra-bundle dds=/tmp/flux3-wide-dds --size 512 --reps 3 --threads 2
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


def _host():
    """The CPU's model name and the instruction sets that matter here."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    wanted = ("fma", "avx2", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile")
    return f"{name}: {' '.join(f for f in wanted if f in flags) or 'none of ' + ' '.join(wanted)}"


def _psnr(a_path, b_path):
    a = np.asarray(Image.open(a_path).convert("RGB"), np.float64)
    b = np.asarray(Image.open(b_path).convert("RGB"), np.float64)
    mse = np.mean((a - b) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--bundle", help="klein's fp32 bundle of the checkpoint (required)")
    p.add_argument(
        "--extra-bundle",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="another bundle of the same checkpoint (fp16, quantized), run the same way; repeatable",
    )
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
    if args.bundle is None:
        p.error("--bundle is required")
    bundles = {"klein fp32": args.bundle}
    for spec in args.extra_bundle:
        name, sep, path = spec.partition("=")
        if not sep or not name or not Path(path, "manifest.json").is_file():
            p.error(f"--extra-bundle {spec!r}: expected NAME=DIR, DIR a klein bundle")
        bundles[f"klein {name}"] = path
    steps = args.steps or json.loads((Path(args.bundle) / "manifest.json").read_text())["model"]["default_steps"]
    work = Path(tempfile.mkdtemp(prefix="flux3-compare-"))
    runs = {side: [] for side in (*bundles, "diffusers")}
    for rep in range(args.reps):
        for side, bundle in bundles.items():
            out = work / f"{side.replace(' ', '-')}-{rep}.png"
            cmd = [args.klein, "generate", PROMPT, "--model", bundle, "--seed", str(args.seed), "--steps", str(steps)]
            cmd += ["--width", str(args.size), "--height", str(args.size), "--threads", str(args.threads)]
            wall, rss, _, err = _run(cmd + ["--timings", "-o", str(out), "--no-verify-hashes"])
            runs[side].append({"wall": wall, "rss": rss, "generate": _klein_generate_seconds(err), "image": out})
        out = work / f"diffusers-{rep}.png"
        cmd = [sys.executable, __file__, "--worker", "--checkpoint", args.checkpoint, "--size", str(args.size)]
        cmd += ["--steps", str(steps), "--seed", str(args.seed), "--threads", str(args.threads), "--out", str(out)]
        wall, rss, stdout, _ = _run(cmd)
        generate = json.loads(stdout.strip().splitlines()[-1])["generate"]
        runs["diffusers"].append({"wall": wall, "rss": rss, "generate": generate, "image": out})
    med = {
        side: {k: statistics.median(r[k] for r in rs) for k in ("wall", "rss", "generate")} for side, rs in runs.items()
    }
    reference = runs["diffusers"][0]["image"]
    print(f"host: {_host()}")
    print(f"{args.size}x{args.size}, {steps} steps, {args.threads} threads, medians of {args.reps} (work dir {work})")
    columns = [("wall s", 8), ("generate s", 11), ("peak RSS MB", 12)]
    columns += [("wall vs diffusers", 18), ("image vs diffusers", 19)]
    print(f"{'':16s} " + " ".join(f"{name:>{width}s}" for name, width in columns))
    d = med["diffusers"]
    for side in runs:
        m = med[side]
        ratio = f"{d['wall'] / m['wall']:.2f}x" if side != "diffusers" else ""
        image = f"{_psnr(runs[side][0]['image'], reference):.1f} dB" if side != "diffusers" else ""
        print(f"{side:16s} {m['wall']:8.1f} {m['generate']:11.1f} {m['rss']:12.0f} {ratio:>18s} {image:>19s}")


if __name__ == "__main__":
    main()
