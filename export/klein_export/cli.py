"""Command line: `klein-export convert | tiny | verify | fixtures`."""

import argparse
import sys
from pathlib import Path

from .checkpoint import CheckpointError

EXIT_USER_ERROR = 2


def _convert(args):
    from .convert import convert

    out = convert(args.checkpoint, args.out, force=args.force, name=args.name, variant=args.variant)
    print(out)
    return 0


def _tiny(args):
    from .tiny import build_tiny

    if Path(args.out).exists():
        raise FileExistsError(f"{args.out}: already exists (choose a new directory)")
    print(build_tiny(args.out, seed=args.seed, preset=args.preset))
    return 0


def _verify(args):
    from .verify import verify

    failed = 0
    for result in verify(args.checkpoint, args.bundle):
        print(result.line(), flush=True)
        failed += not result.ok
    print(f"{'FAILED' if failed else 'passed'}: {failed} case(s) past tolerance")
    return 1 if failed else 0


def _fixtures(args):
    from .fixtures import write_fixtures

    write_fixtures(args.checkpoint, args.out)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="klein-export", description="Export FLUX.2-klein checkpoints to klein ONNX bundles.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="diffusers checkpoint -> bundle")
    c.add_argument("--checkpoint", required=True, help="diffusers-format FLUX.2-klein checkpoint directory")
    c.add_argument("--out", required=True, help="bundle directory to write")
    c.add_argument("--force", action="store_true", help="overwrite an existing bundle")
    c.add_argument("--name", help="model name recorded in the manifest (default: the bundle directory name)")
    c.add_argument("--variant", default="custom", choices=["4b", "9b", "tiny", "custom"], help="model variant recorded in the manifest")
    c.set_defaults(func=_convert)

    t = sub.add_parser("tiny", help="write a random-weight checkpoint (real classes, real tokenizer)")
    t.add_argument("--out", required=True)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--preset",
        default="tiny",
        choices=["tiny", "wide", "4b"],
        help="tiny: the test model; wide: the real 4B widths with 28 Qwen3 layers and 1+2 blocks; 4b: the published 4B architecture",
    )
    t.set_defaults(func=_tiny)

    v = sub.add_parser("verify", help="torch vs ONNX Runtime, per component, at several shapes")
    v.add_argument("--checkpoint", required=True)
    v.add_argument("--bundle", required=True)
    v.set_defaults(func=_verify)

    f = sub.add_parser("fixtures", help="run diffusers' pipeline and write the runtime's reference fixtures")
    f.add_argument("--checkpoint", required=True)
    f.add_argument("--out", required=True)
    f.set_defaults(func=_fixtures)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, FileExistsError, FileNotFoundError) as e:
        print(f"klein-export: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
