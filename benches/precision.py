"""The precision and quantization table: every bundle of one checkpoint against its fp32 bundle.

For each bundle: its size on disk (the manifest's files), klein's peak resident memory and wall time
for one generation (fresh `klein generate` processes, `ru_maxrss` via os.wait4, median of --reps,
repetitions interleaved across bundles), the PSNR of klein's image against the fp32 bundle's (same
prompt, seed, size, steps), and each component's error against the fp32 graph on the same inputs
(`klein-export verify --against`: relative rms and max error, one ONNX Runtime session at a time).

Usage (repository root, in the export venv, `cargo build --release` done):

    python benches/precision.py --reference fp32=BUNDLE_FP32 --bundle fp16=DIR --bundle int8=DIR ... \\
        [--size 512] [--steps 4] [--threads 2] [--reps 3] [--work DIR]
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import image_error, load_rgb, median, print_table, run_child  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROMPT = "a red fox in the snow, golden hour, photograph"


def bundle_bytes(bundle: Path) -> int:
    return sum(f["bytes"] for f in json.loads((bundle / "manifest.json").read_text())["files"].values())


def scheme(bundle: Path) -> str:
    graphs = json.loads((bundle / "manifest.json").read_text())["graphs"]
    parts = []
    for name, spec in graphs.items():
        q = spec.get("quantization")
        label = spec["precision"] + (
            f"+int{q['bits']}" + (f" acc{q['accuracy_level']}" if q.get("accuracy_level") else "") if q else ""
        )
        parts.append(f"{name} {label}")
    return ", ".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", required=True, metavar="NAME=DIR", help="the fp32 bundle")
    p.add_argument(
        "--bundle", action="append", default=[], metavar="NAME=DIR", help="a bundle of the same checkpoint; repeatable"
    )
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--klein", default=str(REPO / "target" / "release" / "klein"))
    p.add_argument("--work")
    p.add_argument("--no-components", action="store_true", help="skip the per-component errors")
    args = p.parse_args(argv)
    bundles = dict(item.split("=", 1) for item in [args.reference] + args.bundle)
    bundles = {name: Path(d) for name, d in bundles.items()}
    reference = next(iter(bundles))
    work = Path(args.work or tempfile.mkdtemp(prefix="klein-precision-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"work directory: {work}\nprompt: {PROMPT!r}, seed {args.seed}, {args.size}x{args.size}, "
        f"{args.steps} steps, {args.threads} threads, {args.reps} reps"
    )
    for name, bundle in bundles.items():
        print(f"{name}: {bundle} ({scheme(bundle)})")

    runs = {name: [] for name in bundles}
    for rep in range(1, args.reps + 1):
        for name, bundle in bundles.items():
            out = work / f"{name}-rep{rep}.png"
            cmd = [
                args.klein,
                "generate",
                PROMPT,
                "-m",
                str(bundle),
                "--seed",
                str(args.seed),
                "--width",
                str(args.size),
                "--height",
                str(args.size),
                "--steps",
                str(args.steps),
                "--threads",
                str(args.threads),
                "-o",
                str(out),
                "-q",
            ]
            r = run_child(cmd, work / f"{name}-rep{rep}.log")
            if r["rc"] != 0:
                print(f"{name} rep {rep}: klein failed (exit {r['rc']}):\n{r['log']}")
                return 1
            runs[name].append(r)
            print(
                f"{name} rep {rep}: {r['wall']:.1f} s, peak RSS {r['rss'] / 2**30:.2f} GiB, "
                f"other processes {r['others']:.2f} CPUs",
                flush=True,
            )

    components = {}
    if not args.no_components:
        from klein_export.against import component_differences

        for name, bundle in bundles.items():
            if name != reference:
                components[name] = {
                    d.component: d for d in component_differences(bundle, bundles[reference], args.size, args.size)
                }
                for d in components[name].values():
                    print(f"{name}: {d.line()}", flush=True)

    want = load_rgb(work / f"{reference}-rep1.png")
    header = [
        "bundle",
        "size MB",
        "peak RSS MiB",
        "time s",
        "PSNR dB",
        "pixels differ %",
        "text encoder rms/max rel",
        "transformer rms/max rel",
        "VAE decoder rms/max rel",
    ]
    rows = []
    for name, bundle in bundles.items():
        err = image_error(load_rgb(work / f"{name}-rep1.png"), want)
        cells = [
            name,
            f"{bundle_bytes(bundle) / 1e6:.1f}",
            f"{median([r['rss'] for r in runs[name]]) / 2**20:.0f}",
            f"{median([r['wall'] for r in runs[name]]):.1f}",
        ]
        cells += [
            "ref" if name == reference else f"{err['psnr']:.1f}",
            "ref" if name == reference else f"{err['differ']:.2f}",
        ]
        for component in ("text_encoder", "transformer", "vae_decoder"):
            d = components.get(name, {}).get(component)
            cells.append("ref" if name == reference else "-" if d is None else f"{d.rms_rel:.1e} / {d.max_rel:.1e}")
        rows.append(cells)
    print()
    print_table(header, rows)
    print(
        "PSNR and pixels: klein's PNG against the reference bundle's (rep 1); time and RSS: medians of fresh processes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
