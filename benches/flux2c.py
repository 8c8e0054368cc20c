"""klein against flux2.c (github.com/antirez/flux2.c, the C implementation of FLUX.2-klein) on one
checkpoint, in one run (issue 15, target 4).

flux2.c reads a diffusers-format 4B checkpoint directly (bf16 safetensors, memory-mapped by default);
klein runs bundles exported from the same checkpoint. Same prompt, seed value, sizes, step count and
threads (flux2.c: `OPENBLAS_NUM_THREADS`; its own kernels are single-threaded). Every repetition is a
fresh process; repetitions are interleaved (rep 1 of every configuration and size, then rep 2, ...).
Per run: wall time spawn to exit, peak RSS (`ru_maxrss` of the child: touched memory-mapped weights
count, for both), CPU seconds and the CPUs other processes used meanwhile (compare.py's `run_child`).
Stages: flux2.c's own phase lines (`Encoding text... done (5.1s)`; the denoising from the arrival
times of its `Step n/N` lines), klein's `--timings`.

flux2.c expects the published checkpoint's file layout: the text encoder in two shards named
`model-00001-of-00002.safetensors` and `model-00002-of-00002.safetensors`. A checkpoint that holds
it in one `model.safetensors` (what `klein-export tiny --preset 4b` writes) is given to flux2.c
through a view made in --work: links to the checkpoint's files, the single file as shard 1, and a
one-tensor placeholder as shard 2 (flux2.c looks every tensor up in shard 1 first). Nothing is copied.

The images are not compared: flux2.c draws its noise with its own generator, so the same seed gives
other noise. Each run's image is checked to exist at the requested size.

Usage (the export venv: `source scripts/python-env.sh`; flux2.c built by benches/flux2c-build.sh):

    python benches/flux2c.py --flux2c FLUX2C_DIR --checkpoint CKPT_4B --bundle int8=BUNDLE \\
        [--bundle fp16=BUNDLE2 ...] [--size 256 --size 512] [--steps 4] [--threads 2] [--reps 3] \\
        [--klein-arg=--cpu-cache --klein-arg=DIR] [--quiet-wait 60] [--work DIR]

Exit status: 0 when every run succeeded, 1 otherwise (the table is printed with what ran).
"""

import argparse
import math
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import (  # noqa: E402
    DEFAULT_KLEIN,
    cpu_model,
    fmt_ratio,
    fmt_s,
    host_isa,
    median,
    parse_klein_timings,
    print_table,
    report_run,
    run_child,
    wait_for_quiet,
)

PHASE_LINE = re.compile(r"(\S.*?)\.\.\. done \(([0-9.]+)s\)")  # `Loading FLUX.2 transformer... done (0.6s)`
STEP_LINE = re.compile(r"^\s*Step \d+/\d+")  # printed as each denoising step ends
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def flux2c_view(checkpoint: Path, work: Path) -> Path:
    """The checkpoint as flux2.c reads it: itself when its text encoder has the two published shards,
    else a directory of links with the single `model.safetensors` as shard 1 and a placeholder shard 2."""
    encoder = checkpoint / "text_encoder"
    if all((encoder / s).exists() for s in SHARDS):
        return checkpoint
    single = encoder / "model.safetensors"
    if not single.exists():
        raise SystemExit(f"{encoder}: neither {' and '.join(SHARDS)} nor model.safetensors")
    import numpy as np
    from safetensors.numpy import save_file

    view = work / "flux2c-checkpoint"
    (view / "text_encoder").mkdir(parents=True, exist_ok=True)
    for entry in checkpoint.iterdir():
        if entry.name != "text_encoder" and not (view / entry.name).exists():
            (view / entry.name).symlink_to(entry.resolve())
    for entry in encoder.iterdir():
        link = view / "text_encoder" / (SHARDS[0] if entry.name == single.name else entry.name)
        if not link.exists():
            link.symlink_to(entry.resolve())
    save_file({"klein_bench_placeholder": np.zeros(1, np.float32)}, str(view / "text_encoder" / SHARDS[1]))
    return view


def flux2c_stages(lines) -> dict:
    """flux2.c's output lines `(seconds since spawn, text)` -> the table's stages, in seconds: load (its
    `Loading ...` phases), text encoder (`Encoding text`), denoise (from the `Denoising` line to the
    last `Step n/N` line, each printed as its step ends; flux2.c prints no time for it) and decode."""
    phases = {}
    for _, line in lines:
        for name, secs in PHASE_LINE.findall(line):
            phases[name.strip().lower()] = phases.get(name.strip().lower(), 0.0) + float(secs)
    start = next((t for t, line in lines if line.startswith("Denoising")), math.nan)
    step_ends = [t for t, line in lines if STEP_LINE.match(line)]
    return {
        "load": sum(v for k, v in phases.items() if k.startswith("loading")),
        "text encoder": phases.get("encoding text", math.nan),
        "denoise": step_ends[-1] - start if step_ends else math.nan,
        "decode": phases.get("decoding image", math.nan),
    }


def image_size(path: Path):
    from PIL import Image

    try:
        with Image.open(path) as im:
            return im.size
    except OSError:
        return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--flux2c", required=True, help="flux2.c checkout with its `flux` binary built (benches/flux2c-build.sh)"
    )
    p.add_argument("--checkpoint", required=True, help="diffusers-format FLUX.2-klein 4B checkpoint")
    p.add_argument(
        "--bundle",
        action="append",
        required=True,
        metavar="NAME=DIR",
        help="klein bundle of that checkpoint; repeatable",
    )
    p.add_argument(
        "--size", type=int, action="append", help="square image side in pixels; repeatable (default 256 and 512)"
    )
    p.add_argument("--prompt", default="a red fox in the snow, golden hour, photograph")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--klein", default=str(DEFAULT_KLEIN))
    p.add_argument(
        "--klein-arg",
        action="append",
        default=[],
        help="an extra argument for every klein run (e.g. --cpu-cache DIR as two)",
    )
    p.add_argument("--work", help="directory for images and logs (default: a new temporary one)")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=0,
        metavar="SECONDS",
        help="before each run, wait up to this long for the machine to fall under 0.2 CPUs",
    )
    args = p.parse_args(argv)

    flux = Path(args.flux2c) / "flux"
    if not os.access(flux, os.X_OK):
        raise SystemExit(f"{flux}: not an executable; build it with benches/flux2c-build.sh {args.flux2c}")
    bundles = [tuple(b.split("=", 1)) for b in args.bundle]
    if any(len(b) != 2 for b in bundles):
        raise SystemExit("--bundle takes NAME=DIR")
    sizes = args.size or [256, 512]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="klein-flux2c-"))
    work.mkdir(parents=True, exist_ok=True)
    view = flux2c_view(Path(args.checkpoint), work)
    print(f"host: {cpu_model()}; {' '.join(host_isa())}; {os.cpu_count()} CPUs; work {work}", flush=True)
    print(f"flux2.c reads {view}", flush=True)

    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    configs = [("flux2.c", None)] + [(f"klein {name}", Path(d)) for name, d in bundles]
    results = {(key, size): [] for key, _ in configs for size in sizes}
    failed = False
    for rep in range(1, args.reps + 1):
        for size in sizes:
            for key, bundle in configs:
                stem = work / f"{key.replace(' ', '-')}-{size}-rep{rep}"
                if bundle is None:
                    cmd = [str(flux), "-d", str(view), "-p", args.prompt, "-W", str(size), "-H", str(size),
                           "-s", str(args.steps), "-S", str(args.seed), "-o", f"{stem}.png"]  # fmt: skip
                else:
                    cmd = [args.klein, "generate", args.prompt, "--model", str(bundle), "--seed", str(args.seed),
                           "--width", str(size), "--height", str(size), "--steps", str(args.steps),
                           "--threads", str(args.threads), "--timings",
                           "-o", f"{stem}.png", *args.klein_arg]  # fmt: skip
                quiet = wait_for_quiet(args.quiet_wait) if args.quiet_wait else math.nan
                c = run_child(cmd, Path(f"{stem}.log"), env=env)
                got = image_size(Path(f"{stem}.png"))
                if c["rc"] != 0 or got != (size, size):
                    print(
                        f"{key} {size} rep {rep}: exit {c['rc']}, image {got}; log {stem}.log:\n{c['log'][-1500:]}",
                        file=sys.stderr,
                    )
                    failed = True
                    continue
                if bundle is None:
                    c["stages"] = flux2c_stages(c["lines"])
                else:
                    t = parse_klein_timings(c["log"], args.steps)
                    c["stages"] = {
                        "load": t["load"],
                        "text encoder": t["text encoder"],
                        "denoise": t["denoise"],
                        "decode": t["decode"],
                    }
                c["quiet"] = quiet
                results[(key, size)].append(c)
                report_run(f"{key} {size}x{size}", rep, c)

    for size in sizes:
        print(f"\n{size}x{size}, {args.steps} steps, {args.threads} threads, median of {args.reps}:")
        header = ["", *(key for key, _ in configs)]
        stage_names = sorted({s for key, _ in configs for r in results[(key, size)] for s in r["stages"]})
        rows = [
            [
                f"{s} (s)",
                *(fmt_s(median([r["stages"].get(s, math.nan) for r in results[(key, size)]])) for key, _ in configs),
            ]
            for s in stage_names
        ]
        walls = {key: median([r["wall"] for r in results[(key, size)]]) for key, _ in configs}
        rss = {key: median([r["rss"] / 2**30 for r in results[(key, size)]]) for key, _ in configs}
        rows.append(["end to end, process (s)", *(fmt_s(walls[key]) for key, _ in configs)])
        rows.append(["speed against flux2.c", *(fmt_ratio(walls["flux2.c"], walls[key]) for key, _ in configs)])
        rows.append(["peak RSS (GiB)", *(f"{rss[key]:.2f}" for key, _ in configs)])
        print_table(header, rows)
        for key, _ in configs:
            per_rep = ", ".join(f"{r['wall']:.1f}" for r in results[(key, size)])
            print(f"  {key}: per-rep end to end {per_rep} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
