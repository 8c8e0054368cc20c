"""The VAE decoder graph of each bundle at one size, each bundle in a fresh process: the seconds of
each run (the first ones also allocate and page-fault) and, with --profile, ONNX Runtime's seconds
per operator type in the last run.

    benches/avx2-host.sh python benches/vae_decoder.py --bundle dds7c=/work/big/wide-dds7c --size 512 --profile

The input is random latents ([1, 128, size/16, size/16], the same for every bundle), decoded whole
(no tiles), with klein's session settings for the CPU (2 threads by default, denormals as zero).
"""

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, time
import numpy as np, onnxruntime as ort
path, side, threads, runs, profile = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
options = ort.SessionOptions()
options.intra_op_num_threads = threads
options.add_session_config_entry("session.set_denormal_as_zero", "1")
if profile:
    options.enable_profiling = True
    options.profile_file_prefix = profile
session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
latents = np.random.default_rng(0).standard_normal((1, 128, side // 16, side // 16), dtype=np.float32)
feeds = {session.get_inputs()[0].name: latents}
seconds = []
for _ in range(runs):
    start = time.perf_counter()
    session.run(None, feeds)
    seconds.append(time.perf_counter() - start)
by_op = {}
if profile:
    events = json.load(open(session.end_profiling()))
    last = [e for e in events if e.get("name") == "model_run"][-1]["ts"]
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= last:
            by_op[e["args"]["op_name"]] = by_op.get(e["args"]["op_name"], 0.0) + e["dur"] / 1e6
print(json.dumps({"seconds": seconds, "by_op": by_op}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", action="append", required=True, help="NAME=DIR (repeatable)")
    parser.add_argument("--size", type=int, default=512, help="image side in pixels, a multiple of 16 (default 512)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="runs per process; the last one is profiled (default 3)")
    parser.add_argument("--profile", action="store_true", help="print the last run's seconds per operator type")
    args = parser.parse_args()
    if args.size < 16 or args.size % 16 or args.runs < 1:
        parser.error("--size must be a positive multiple of 16 and --runs at least 1")
    for item in args.bundle:
        name, _, bundle = item.partition("=")
        profile = f"/tmp/vae_decoder_{name}_profile" if args.profile else ""
        flags = [str(args.size), str(args.threads), str(args.runs), profile]
        run = subprocess.run(
            [sys.executable, "-c", CHILD, f"{bundle}/vae_decoder.onnx", *flags], capture_output=True, text=True
        )
        if run.returncode:
            print(f"{name}: failed ({run.returncode}): {run.stderr.strip()[-300:]}")
            return run.returncode
        result = json.loads(run.stdout.strip().splitlines()[-1])
        runs = ", ".join(f"{s:.2f}" for s in result["seconds"])
        print(f"{name}: {args.size}x{args.size}, {args.threads} threads: runs {runs} s")
        by_op = sorted(result["by_op"].items(), key=lambda kv: -kv[1])
        total = sum(seconds for _, seconds in by_op)
        if by_op:
            print(f"  the last run: {total:.2f} s in operators")
        for op, seconds in by_op:
            print(f"    {op:32} {seconds:7.3f} s  {100 * seconds / total:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
