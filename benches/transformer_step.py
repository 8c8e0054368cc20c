"""One transformer step of each bundle's graph at a given size, each run in a fresh process, the
bundles alternating, with the step's seconds and the process's peak RSS; then the median of each.

    python benches/transformer_step.py --bundle plain=/work/big/wide-fp32 \
        --bundle fused=/work/big/wide-fused --size 1024 --reps 2 --threads 2 [--runs 3] [--no-arena]

The inputs are random (latents, 512 prompt tokens) and the same for every bundle; the largest
difference between the bundles' outputs is printed, so that two graphs of one checkpoint (for
example with and without fused attention) can be compared for speed, memory and agreement.
"""

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, resource, sys, time
import numpy as np, onnxruntime as ort
path, side, threads, out, profile = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
runs, arena = int(sys.argv[6]), sys.argv[7] == "arena"
options = ort.SessionOptions()
options.intra_op_num_threads = threads
options.enable_cpu_mem_arena = arena
options.enable_mem_pattern = arena  # klein's transformer runs without both
options.add_session_config_entry("session.set_denormal_as_zero", "1")  # as klein's sessions
session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
shapes = {i.name: i.shape for i in session.get_inputs()}
grid = side // 16
rng = np.random.default_rng(0)
ids = np.stack(np.meshgrid([0], np.arange(grid), np.arange(grid), [0], indexing="ij"), -1).reshape(-1, 4)
feeds = {
    "latents": rng.standard_normal((1, grid * grid, shapes["latents"][2]), dtype=np.float32),
    "prompt_embeds": rng.standard_normal((1, 512, shapes["prompt_embeds"][2]), dtype=np.float32),
    "timestep": np.array([0.7], np.float32),
    "img_ids": ids.astype(np.int64),
    "txt_ids": np.stack([np.zeros(512), np.zeros(512), np.zeros(512), np.arange(512)], -1).astype(np.int64),
}
timed = []  # every run: the first ones also allocate and page-fault
for _ in range(runs):
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    velocity = session.run(None, feeds)[0]
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    timed.append({"seconds": seconds, "user": after.ru_utime - before.ru_utime,
                  "system": after.ru_stime - before.ru_stime, "minor_faults": after.ru_minflt - before.ru_minflt})
np.save(out, velocity[0, :256])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
by_op, run_seconds = {}, []
if profile:
    # A second session, built after the timed run, profiles its runs.
    del session
    options.enable_profiling = True
    options.profile_file_prefix = profile
    profiled = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    for _ in range(3):  # the last run's nodes are counted: the first ones still allocate
        profiled.run(None, feeds)
    events = json.load(open(profiled.end_profiling()))
    run_events = [e for e in events if e.get("name") == "model_run"]
    last = run_events[-1]["ts"]
    run_seconds = [r["dur"] / 1e6 for r in run_events]
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= last:
            op = e["args"]["op_name"]
            by_op[op] = by_op.get(op, 0.0) + e["dur"] / 1e6
print(json.dumps({"seconds": seconds, "peak_gib": peak, "timed": timed, "by_op": by_op, "runs": run_seconds}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", action="append", required=True, help="NAME=DIR (repeatable)")
    parser.add_argument("--size", type=int, default=1024, help="image side in pixels (default 1024)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--runs",
        type=int,
        default=2,
        help="runs of the step per process, each printed; the last one counts (default 2)",
    )
    parser.add_argument(
        "--no-arena",
        action="store_true",
        help="without ONNX Runtime's CPU memory arena and memory pattern, as klein runs the transformer",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also run the step 3 times in a profiled session and print the last run's seconds per operator type",
    )
    args = parser.parse_args()
    import numpy as np

    bundles = dict(b.split("=", 1) for b in args.bundle)
    results = {name: [] for name in bundles}
    for rep in range(args.reps):
        for name, path in bundles.items():
            out = f"/tmp/transformer_step_{name}.npy"
            run = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    CHILD,
                    f"{path}/transformer.onnx",
                    str(args.size),
                    str(args.threads),
                    out,
                    f"/tmp/transformer_step_{name}_profile" if args.profile else "",
                    str(max(args.runs, 1)),
                    "no-arena" if args.no_arena else "arena",
                ],
                capture_output=True,
                text=True,
            )
            if run.returncode:
                print(f"{name} rep {rep + 1}: failed ({run.returncode}): {run.stderr.strip()[-300:]}")
                continue
            result = json.loads(run.stdout.strip().splitlines()[-1])
            results[name].append(result)
            print(f"{name} rep {rep + 1}: step {result['seconds']:.2f} s, peak RSS {result['peak_gib']:.2f} GiB")
            for i, t in enumerate(result["timed"]):
                print(
                    f"  run {i + 1}: {t['seconds']:.2f} s (user {t['user']:.1f} s, system {t['system']:.1f} s, "
                    f"{t['minor_faults']} minor page faults)"
                )
            by_op = sorted(result["by_op"].items(), key=lambda kv: -kv[1])
            if by_op:
                total = sum(seconds for _, seconds in by_op)
                walls = ", ".join(f"{w:.2f}" for w in result["runs"])
                print(f"  profiled runs: {walls} s; the last {total:.2f} s in operators")
                for op, seconds in by_op:
                    print(f"    {op:32} {seconds:7.3f} s  {100 * seconds / total:5.1f}%")
    print(f"\n{args.size}x{args.size}, {args.threads} threads, median of {args.reps}:")
    for name, runs in results.items():
        if runs:
            step = statistics.median(r["seconds"] for r in runs)
            peak = statistics.median(r["peak_gib"] for r in runs)
            print(f"  {name:12} step {step:7.2f} s   peak RSS {peak:6.2f} GiB")
    names = list(bundles)
    first = np.load(f"/tmp/transformer_step_{names[0]}.npy")
    for name in names[1:]:
        other = np.load(f"/tmp/transformer_step_{name}.npy")
        diff, scale = np.abs(first - other).max(), np.abs(first).max()
        print(f"  max |{names[0]} - {name}| = {diff:.3g} (outputs up to {scale:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
