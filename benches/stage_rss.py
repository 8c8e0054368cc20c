"""Peak resident memory of each stage of one `klein generate` run.

    python benches/stage_rss.py --model BUNDLE --size 1024 [--steps 4] [--threads 2] [--klein BIN]
        [--cpu-cache DIR] [--vae-tile-size PIXELS]

The klein process's RSS (`/proc/PID/status` VmRSS) is sampled every 0.1 s. Its stderr lines are
time-stamped as they arrive; the stages are placed on that clock from the `--timings` summary,
which lists them in the order they ran (load text encoder, encode prompt, load transformer, denoise,
load VAE decoder, decode), starting at the `model:` line that klein prints once the bundle is open.
A stage's peak is the highest sample inside it (stages shorter than a sample period may show the
neighbour's value). Also printed: the whole run's peak (`ru_maxrss`, exact) and wall time.
"""

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

STAGES = ("load text encoder", "encode prompt", "load transformer", "denoise", "load VAE decoder", "decode")
TIMING = re.compile(r"^\s*(" + "|".join(STAGES) + r"):\s+([0-9.]+) s$")


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--klein", default=str(Path(__file__).resolve().parents[1] / "target/release/klein"))
    p.add_argument("--prompt", default="a red fox in the snow, golden hour, photograph")
    p.add_argument("--cpu-cache", help="klein's --cpu-cache DIR (prepacked graphs saved once)")
    p.add_argument("--vae-tile-size", help="klein's --vae-tile-size PIXELS (tiles the VAE)")
    args = p.parse_args()
    out = Path(f"/tmp/stage_rss_{os.getpid()}.png")
    cmd = [args.klein, "generate", args.prompt, "--model", args.model, "--width", str(args.size)]
    cmd += ["--height", str(args.size), "--steps", str(args.steps), "--threads", str(args.threads)]
    cmd += ["--seed", "42", "--timings", "-o", str(out)]
    if args.cpu_cache:
        cmd += ["--cpu-cache", args.cpu_cache]
    if args.vae_tile_size:
        cmd += ["--vae-tile-size", args.vae_tile_size]
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    samples, lines = [], []

    def sample():
        while child.poll() is None:
            samples.append((time.perf_counter() - start, rss_bytes(child.pid)))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for line in child.stderr:
        lines.append((time.perf_counter() - start, line.rstrip("\n")))
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    sampler.join()
    out.unlink(missing_ok=True)
    if status:
        print("\n".join(text for _, text in lines), file=sys.stderr)
        return 1
    opened = next(t for t, text in lines if text.startswith("model:"))
    durations = [(m.group(1), float(m.group(2))) for _, text in lines if (m := TIMING.match(text))]
    print(f"{args.model}, {args.size}x{args.size}, {args.steps} steps, {args.threads} threads")
    t = opened
    for stage, seconds in durations:
        inside = [rss for at, rss in samples if t <= at <= t + seconds]
        peak = max(inside, default=0) / 2**30
        print(f"  {stage:18} {seconds:8.2f} s   peak RSS {peak:6.2f} GiB")
        t += seconds
    print(f"  whole run          {wall:8.2f} s   peak RSS {usage.ru_maxrss / 2**20:6.2f} GiB (ru_maxrss)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
