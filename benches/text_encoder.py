"""One text-encoder run of each bundle's graph, each bundle in a fresh process, with the run's
seconds (the second of two; the first pays the page faults) and, with --profile, ONNX Runtime's
seconds per operator type; then the largest difference between the bundles' outputs.

    python benches/text_encoder.py --bundle before=/work/big/wide-dds3 --bundle after=/work/big/wide-dds4 \
        --real-tokens 40 --no-prepack --profile

The input is 512 token ids (random, the same for every bundle), the first `--real-tokens` of them
real and the rest padding, as the pipeline pads a prompt. `--no-prepack` runs the graph as the CLI
runs a released int8 text encoder (`session.disable_prepacking`).

With `--alternate N`, every bundle's session is made in one process instead, each run once untimed,
then N rounds time each session once in turn: the median of each and the per-round ratio of each
bundle to the first, for differences smaller than the noise between fresh processes.
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

# Both children's start: the session options klein sets, and the 512 ids of which `real` are real.
SETUP = r"""
import json, sys, time
import numpy as np, onnxruntime as ort


def options_for(threads, no_prepack):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.set_denormal_as_zero", "1")  # as klein's sessions
    if no_prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    return options


def feeds_for(real):
    return {
        "input_ids": np.random.default_rng(0).integers(0, 1000, (1, 512)).astype(np.int64),
        "attention_mask": (np.arange(512) < real).astype(np.int64)[None],
    }
"""

CHILD = (
    SETUP
    + r"""
path, real, threads, no_prepack, profile, out = sys.argv[1:7]
options = options_for(int(threads), no_prepack == "1")
if profile == "1":
    options.enable_profiling = True
    options.profile_file_prefix = out[: -len(".npy")] + "-profile"  # in the temporary directory
session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
feeds = feeds_for(int(real))
session.run(None, feeds)
start = time.perf_counter()
embeds = session.run(None, feeds)[0]
print(f"run {time.perf_counter() - start:.3f} s")
np.save(out, embeds)
if profile == "1":
    events = json.load(open(session.end_profiling()))
    last = [e for e in events if e.get("name") == "model_run"][-1]["ts"]
    by_op = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= last:
            by_op[e["args"]["op_name"]] = by_op.get(e["args"]["op_name"], 0) + e["dur"] / 1e6
    for op, seconds in sorted(by_op.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {op:<34} {seconds:.3f} s")
"""
)

ALTERNATE = (
    SETUP
    + r"""
real, threads, no_prepack, rounds = (int(a) for a in sys.argv[1:5])
sessions = {}
for item in sys.argv[5:]:
    name, _, path = item.partition("=")
    options = options_for(threads, no_prepack)
    sessions[name] = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
feeds = feeds_for(real)
for session in sessions.values():
    session.run(None, feeds)
times = {name: [] for name in sessions}
for _ in range(rounds):
    for name, session in sessions.items():
        start = time.perf_counter()
        session.run(None, feeds)
        times[name].append(time.perf_counter() - start)
first = next(iter(times))
for name, runs in times.items():
    print(f"{name}: median {np.median(runs):.3f} s ({', '.join(f'{t:.3f}' for t in runs)})")
    if name != first:
        ratios = [t / t0 for t, t0 in zip(runs, times[first])]
        print(f"  / {first} per round: {min(ratios):.3f}-{max(ratios):.3f}, median {np.median(ratios):.3f}")
"""
)


def _alternate(args, graphs) -> int:
    flags = [str(args.real_tokens), str(args.threads), str(int(args.no_prepack)), str(args.alternate)]
    items = [f"{name}={graph}" for name, graph in graphs]
    return subprocess.run([sys.executable, "-c", ALTERNATE, *flags, *items]).returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", action="append", required=True, metavar="NAME=DIR")
    p.add_argument("--real-tokens", type=int, default=40, help="prompt tokens before the padding (1-512)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-prepack", action="store_true", help="as the CLI runs a released int8 text encoder")
    p.add_argument("--profile", action="store_true", help="also print seconds per operator type")
    p.add_argument("--alternate", type=int, metavar="N", help="N rounds of every session in one process")
    args = p.parse_args()
    if not 1 <= args.real_tokens <= 512:
        p.error("--real-tokens must be 1-512")
    graphs = []
    for item in args.bundle:
        name, _, bundle = item.partition("=")
        graph = Path(bundle) / "text_encoder.onnx"
        if not graph.is_file():
            p.error(f"{graph}: no text encoder graph")
        graphs.append((name, graph))
    if args.alternate is not None:
        if args.alternate < 1 or args.profile:
            p.error("--alternate takes a count of at least 1, and no --profile")
        return _alternate(args, graphs)
    import numpy as np

    outputs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, graph in graphs:
            out = Path(tmp) / f"{name}.npy"
            flags = [str(args.real_tokens), str(args.threads), str(int(args.no_prepack)), str(int(args.profile))]
            print(f"{name}:", flush=True)
            result = subprocess.run([sys.executable, "-c", CHILD, str(graph), *flags, str(out)], text=True)
            if result.returncode != 0:
                return result.returncode
            outputs[name] = np.load(out)
    names = list(outputs)
    for other in names[1:]:
        diff = float(np.abs(outputs[other] - outputs[names[0]]).max())
        print(f"max |{other} - {names[0]}| = {diff:.3g} (outputs up to {float(np.abs(outputs[names[0]]).max()):.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
