"""Command line: `klein-export convert | lora-map | preview | quantize | tiny | verify | ranges | fixtures`."""

import argparse
import os
import sys
import time
from pathlib import Path

from .errors import CheckpointError, KleinExportError, QuantizationError
from .lora_merge import parse_lora
from .options import (
    BITS,
    DEFAULT_BLOCK_SIZE,
    METHODS,
    PRECISIONS,
    QuantizationConfig,
    default_components,
    parse_components,
)
from .signals import Stopped, stops_raised

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # as the klein CLI, and shells, report SIGINT (128 + its number, as SIGTERM's 143)


def _quantization(args, required=False):
    """The QuantizationConfig the flags ask for (None without --quantize)."""
    if not args.quantize:
        if required:
            # dynamic and static quantization are 8-bit only; MatMulNBits takes both widths.
            widths = "int8|int4" if args.method in (None, "nbits") else "int8"
            raise QuantizationError(f"--quantize {widths} is required")
        given = [
            flag
            for flag, value in (("--components", args.components), ("--block-size", args.block_size))
            if value is not None
        ]
        if args.method is not None:
            given.append("--method")
        if args.reduce_range:
            given.append("--reduce-range")
        if given or args.asymmetric or args.accuracy_level:
            raise QuantizationError(f"{', '.join(given) or 'the quantization flags'} apply with --quantize only")
        return None
    method = METHODS[args.method or "nbits"]
    components = ",".join(default_components(method)) if args.components is None else args.components
    return QuantizationConfig(
        bits=BITS[args.quantize],
        block_size=DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size,
        symmetric=not args.asymmetric,
        accuracy_level=args.accuracy_level,
        components=parse_components(components, method),
        method=method,
        reduce_range=args.reduce_range,
    )


def _convert(args):
    from .convert import convert

    start = time.perf_counter()
    out = convert(
        args.checkpoint,
        args.out,
        force=args.force,
        name=args.name,
        variant=args.variant,
        precision=args.precision,
        quantization=_quantization(args),
        static_shapes=args.static_shapes,
        refs=args.refs,
        loras=[parse_lora(text) for text in args.lora],
        transformer=args.transformer,
        cache=args.cache,
        log=_progress,
    )
    _progress(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    print(out)
    return 0


def _pull(args):
    from .convert import convert
    from .errors import CheckpointError
    from .hub import fetch_bundle, is_hub_id, resolve_checkpoint
    from .models import check_name, default_name, models_dir

    hub = is_hub_id(args.model)
    if args.name is None and not hub:
        raise CheckpointError(f"{args.model}: not a Hub id (ORG/NAME); give --name for a local checkpoint")
    name = check_name(args.name or default_name(args.model) + (f"-{args.quantize}" if args.quantize else ""))
    folder = Path(args.models_dir) if args.models_dir else models_dir()
    if folder is None:
        raise CheckpointError("no models folder: set KLEIN_MODELS_DIR, or give --models-dir")
    start = time.perf_counter()
    bundle = fetch_bundle(args.model, args.revision, log=_progress) if hub else None
    if bundle is not None:
        out = _install_bundle(bundle, folder / name, args)
    else:
        checkpoint = resolve_checkpoint(args.model, args.revision, log=_progress)
        out = convert(
            checkpoint,
            folder / name,
            force=args.force,
            name=name,
            precision=args.precision,
            quantization=_quantization(args),
            cache=args.cache,
            log=_progress,
        )
    _progress(f"installed {name} in {out} in {time.perf_counter() - start:.1f} s")
    _progress(f'use it by name: klein generate --model {name} "a red fox in the snow"')
    print(out)
    return 0


def _install_bundle(bundle, out, args):
    """A downloaded bundle, copied (or quantized) into `out`."""
    import shutil

    from .atomic import atomic_directory, check_output
    from .errors import BundleExistsError, CheckpointError
    from .quantize import quantize_copy

    if args.precision != "fp32":
        raise CheckpointError(f"{args.model} holds a bundle, whose precision is set: leave out --precision")
    quantization = _quantization(args)
    if quantization is not None:
        return quantize_copy(bundle, out, quantization, force=args.force, log=_progress)
    check_output(out, args.force, [(bundle, "the download")], error=BundleExistsError)
    with atomic_directory(out) as tmp:
        for path in bundle.iterdir():
            shutil.copyfile(path, tmp / path.name)  # the files, not the Hub cache's links to them
    return out


def _progress(message: str) -> None:
    """A progress line, on stderr (stdout is the bundle's path, which scripts read)."""
    print(f"klein-export: {message}", file=sys.stderr, flush=True)


def _lora_map(args):
    from .lora_map import add_lora_map

    targets = add_lora_map(args.checkpoint, args.bundle)
    print(f"{args.bundle}: LoRA map of {len(targets)} linear layers written to manifest.json")
    return 0


def _preview(args):
    from .preview import add_preview

    preview = add_preview(args.checkpoint, args.bundle)
    print(f"{args.bundle}: step-preview map written to manifest.json (fit RMSE {preview['fit_rmse']})")
    return 0


def _quantize(args):
    from .quantize import quantize_copy

    print(quantize_copy(args.bundle, args.out, _quantization(args, required=True), force=args.force))
    return 0


def _ranges(args):
    from .precision import measure_ranges, summarise_ranges

    for line in summarise_ranges(measure_ranges(args.checkpoint, steps=args.steps, size=args.size), top=args.top):
        print(line)
    return 0


def _tiny(args):
    if args.preset.startswith("flux3"):
        from .flux3_tiny import build_flux3

        if args.kv:
            raise CheckpointError("--kv is a FLUX.2-klein variant; FLUX.3 presets are step-distilled or --base")
        print(build_flux3(args.out, seed=args.seed, preset=args.preset, distilled=not args.base))
        return 0
    from .tiny import build_tiny

    print(build_tiny(args.out, seed=args.seed, preset=args.preset, distilled=not args.base, kv=args.kv))
    return 0


def _print_cpu_note(bundle):
    """How this CPU runs the bundle's int8 codes, where it has any: the errors verify reports are
    this CPU's (int8_kernels.py)."""
    from .int8_kernels import cpu_note
    from .manifest import read_manifest

    note = cpu_note(read_manifest(bundle)["graphs"])
    if note:
        print(f"{bundle}: {note}", flush=True)


def _verify(args):
    if not (args.checkpoint or args.against):
        raise CheckpointError("verify needs --checkpoint (or --against REFERENCE_BUNDLE)")
    if args.against and args.transformer:
        raise CheckpointError("--transformer goes with --checkpoint, not --against (which compares two bundles)")
    from .manifest import check_transformer_source, read_manifest
    from .verify import check_verifiable, image_cases, verify, verify_images

    if args.checkpoint and not args.against and _verify_flux3(args):
        return _verify_flux3(args, run=True)
    if not args.against:  # before the bundles are hashed
        check_transformer_source(read_manifest(args.bundle), args.bundle, args.transformer)
    for bundle in filter(None, (args.bundle, args.against)):
        check_verifiable(bundle)
    if args.against:
        return _verify_against(args)

    _print_cpu_note(args.bundle)
    failed = 0
    if not args.images_only:
        for result in verify(args.checkpoint, args.bundle, transformer=args.transformer):
            print(result.line(), flush=True)
            failed += not result.ok
    if not args.no_images:
        for result in verify_images(args.checkpoint, args.bundle, image_cases(args.size), args.transformer):
            print(result.line(), flush=True)
            failed += not result.ok
    print(f"{'FAILED' if failed else 'passed'}: {failed} case(s) past tolerance")
    return 1 if failed else 0


def _verify_flux3(args, run=False):
    """A FLUX.3 checkpoint's bundle: per component and end to end (flux3_verify.py); with `run`
    False, whether the checkpoint is a FLUX.3 one."""
    from .flux3 import is_flux3

    if not run:
        return is_flux3(args.checkpoint)
    if args.transformer:
        raise CheckpointError("--transformer is not available for FLUX.3 Image Klein checkpoints yet")
    from .flux3_verify import IMAGE_CASES, verify, verify_images
    from .verify import check_verifiable

    check_verifiable(args.bundle)
    failed = 0
    results = [] if args.images_only else verify(args.checkpoint, args.bundle)
    cases = IMAGE_CASES if args.size is None else ({**IMAGE_CASES[0], "width": args.size, "height": args.size},)
    images = [] if args.no_images else verify_images(args.checkpoint, args.bundle, cases)
    for result in (*results, *images):
        print(result.line(), flush=True)
        failed += not result.ok
    print(f"{'FAILED' if failed else 'passed'}: {failed} case(s) past tolerance")
    return 1 if failed else 0


def _verify_against(args):
    from .against import component_differences, image_difference

    for bundle in (args.bundle, args.against):
        _print_cpu_note(bundle)
    size = 512 if args.size is None else args.size
    if not args.images_only:
        for difference in component_differences(args.bundle, args.against, size, size):
            print(difference.line(), flush=True)
    if args.no_images:
        return 0
    result = image_difference(args.bundle, args.against, size, size)
    print(result.line(), flush=True)
    return 0 if result.ok else 1


def _fixtures(args):
    from .fixtures import write_fixtures

    write_fixtures(args.checkpoint, args.out, force=args.force)
    return 0


def _add_quantization_args(p):
    p.add_argument(
        "--quantize",
        choices=sorted(BITS),
        help="quantization of the MatMul weights of --components (weight-only MatMulNBits unless --method dynamic)",
    )
    p.add_argument(
        "--method",
        choices=sorted(METHODS),
        help="nbits (default): weight-only com.microsoft.MatMulNBits, blockwise, any device but CoreML; "
        "dynamic: int8 weights per output channel and uint8 activations per tensor at run time "
        "(com.microsoft.DynamicQuantizeMatMul, CPU only: integer GEMMs, the fastest on the CPU, larger error); "
        "static: the VAE decoder's convolutions in int8 (QDQ, activation ranges calibrated on this bundle's "
        "own latents; CPU only)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        help=f"weights per quantization block along K: 16, 32, 64, 128 or 256 (default {DEFAULT_BLOCK_SIZE})",
    )
    p.add_argument(
        "--components",
        help="comma-separated components to quantize (default text_encoder,transformer; with --method static: "
        "vae_decoder, the only one it takes; the VAE encoder is never quantized)",
    )
    p.add_argument(
        "--asymmetric", action="store_true", help="a zero point per block (default: symmetric, no zero points)"
    )
    p.add_argument(
        "--reduce-range",
        action="store_true",
        help="--method dynamic or static: int8 weight codes in [-64, 64] (7 bits) instead of [-127, 127], "
        "so that CPUs without VNNI (AVX2 only) run the fast u8 x s8 kernels without overflow; a little "
        "larger error, no change where the CPU has VNNI",
    )
    p.add_argument(
        "--accuracy-level",
        type=int,
        default=0,
        choices=range(5),
        help="MatMulNBits accuracy_level: 0 unset (float compute, the default), 1 fp32, 2 fp16, 3 bf16, "
        "4 int8 compute of the activations",
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="klein-export", description="Export FLUX.2-klein checkpoints to klein ONNX bundles."
    )
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="diffusers checkpoint -> bundle")
    c.add_argument(
        "--checkpoint",
        required=True,
        help="diffusers-format FLUX.2-klein checkpoint: a directory, or a Hugging Face Hub id (ORG/NAME, "
        "downloaded into the Hugging Face cache: only the files the export reads)",
    )
    c.add_argument("--revision", help="with a Hub id: the branch, tag or commit (default main)")
    c.add_argument("--out", required=True, help="bundle directory to write")
    c.add_argument(
        "--transformer",
        metavar="FILE",
        help="a fine-tuned transformer as one .safetensors file (BFL, ComfyUI or diffusers key names; float32, "
        "float16 or bfloat16), exported instead of the checkpoint's transformer weights; its architecture is the "
        "checkpoint's transformer/config.json, and everything else comes from --checkpoint",
    )
    c.add_argument(
        "--cache",
        metavar="DIR",
        default=os.environ.get("KLEIN_EXPORT_CACHE") or None,
        help="keep each exported component in DIR, keyed by the files and options its export reads; a later "
        "convert of the same checkpoint (with another LoRA, transformer file or static shapes) copies what is "
        "unchanged, such as the text encoder, instead of exporting it again (default: $KLEIN_EXPORT_CACHE; none)",
    )
    c.add_argument(
        "--force", action="store_true", help="replace an existing bundle (a bundle or an empty directory only)"
    )
    c.add_argument("--name", help="model name recorded in the manifest (default: the bundle directory name)")
    c.add_argument(
        "--variant",
        default="custom",
        choices=["4b", "9b", "tiny", "custom"],
        help="model variant recorded in the manifest",
    )
    c.add_argument(
        "--precision",
        default="fp32",
        choices=PRECISIONS,
        help="fp16: Linear/Conv/embedding weights and their products in float16; norms, modulation, attention, RoPE "
        "and the residual stream stay float32 (bf16 is refused: ONNX Runtime's CPU provider cannot run it)",
    )
    c.add_argument(
        "--static-shapes",
        metavar="WxH,...",
        help="fixed-shape graphs for CoreML, one set per WIDTHxHEIGHT bucket (e.g. 1024x1024,768x1024,1024x768), "
        "batch 1; the runtime picks the bucket of the requested size and refuses others",
    )
    c.add_argument(
        "--refs",
        type=int,
        default=0,
        help="with --static-shapes: reference images per generation, each of the output's size (default 0)",
    )
    c.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="FILE[:SCALE]",
        help="merge this LoRA into the transformer before export (repeatable; scale default 1, may be negative); "
        "for bundles the runtime cannot merge into at load time (static shapes, --quantize)",
    )
    _add_quantization_args(c)
    c.set_defaults(func=_convert)

    pl = sub.add_parser(
        "pull",
        help="download a checkpoint from the Hugging Face Hub and convert it into klein's models folder, "
        "where --model takes it by name",
    )
    pl.add_argument(
        "model",
        help="a Hub id (ORG/NAME, e.g. black-forest-labs/FLUX.2-klein-4B) of a diffusers checkpoint, which is "
        "converted, or of a klein bundle, whose files are checked against its manifest's sha256; or a local "
        "checkpoint directory with --name",
    )
    pl.add_argument("--revision", help="the branch, tag or commit (default main)")
    pl.add_argument(
        "--name",
        help="the installed model's name, what --model takes (default: the repository's name in lower case, "
        "with -int8 or -int4 when quantized); --model ORG/NAME also finds the default name",
    )
    pl.add_argument(
        "--models-dir",
        metavar="DIR",
        help="klein's models folder (default: $KLEIN_MODELS_DIR, else $XDG_DATA_HOME/klein/models, else "
        "~/.local/share/klein/models)",
    )
    pl.add_argument("--precision", default="fp32", choices=PRECISIONS, help="as convert's --precision")
    pl.add_argument("--force", action="store_true", help="replace an installed model of that name")
    pl.add_argument(
        "--cache",
        metavar="DIR",
        default=os.environ.get("KLEIN_EXPORT_CACHE") or None,
        help="as convert's --cache (default: $KLEIN_EXPORT_CACHE; none)",
    )
    _add_quantization_args(pl)
    pl.set_defaults(func=_pull)

    m = sub.add_parser(
        "lora-map",
        help="write the LoRA map (where each linear layer's weight lives) into a bundle exported without one",
    )
    m.add_argument("--checkpoint", required=True, help="the checkpoint the bundle was exported from")
    m.add_argument("--bundle", required=True, help="an fp32 or fp16 bundle with dynamic shapes (updated in place)")
    m.set_defaults(func=_lora_map)

    pv = sub.add_parser(
        "preview",
        help="fit the step-preview map (latents to RGB) on the checkpoint's VAE and write it into a bundle "
        "exported without one",
    )
    pv.add_argument("--checkpoint", required=True, help="the checkpoint the bundle was exported from")
    pv.add_argument("--bundle", required=True, help="the bundle (its manifest.json is updated in place)")
    pv.set_defaults(func=_preview)

    q = sub.add_parser("quantize", help="bundle -> a copy with weight-only quantized graphs (no re-export)")
    q.add_argument("--bundle", required=True, help="bundle to quantize (left unchanged)")
    q.add_argument("--out", required=True, help="bundle directory to write")
    q.add_argument(
        "--force", action="store_true", help="replace an existing bundle (a bundle or an empty directory only)"
    )
    _add_quantization_args(q)
    q.set_defaults(func=_quantize)

    t = sub.add_parser("tiny", help="write a random-weight checkpoint (real classes, real tokenizer)")
    t.add_argument("--out", required=True, help="checkpoint directory to write (diffusers format)")
    t.add_argument("--seed", type=_seed, default=0, help="seed of the random weights, 0 to 2**63-1 (default 0)")
    t.add_argument(
        "--preset",
        default="tiny",
        choices=["tiny", "wide", "4b", "9b-wide", "9b", "flux3-tiny", "flux3-wide", "flux3"],
        help="tiny: the test model; wide: the real 4B widths with 28 Qwen3 layers and 1+2 blocks; "
        "4b: the published 4B architecture; 9b-wide: the real 9B widths (Qwen3-8B's 4096, transformer 32 x 128, "
        "joint dim 12288) with 4 Qwen3 layers, out layers 1/2/3 (recorded in model_index.json) and 1+2 blocks; "
        "9b: the published 9B architecture (17 B parameters: about 70 GB of memory to build); "
        "flux3-tiny, flux3-wide, flux3: FLUX.3 Image Klein's test model, its published widths with 8 Qwen3-VL "
        "layers and 1+2 blocks, and its published architecture",
    )
    kind = t.add_mutually_exclusive_group()
    kind.add_argument(
        "--base",
        action="store_true",
        help="a base (non-distilled) checkpoint: 50 steps and classifier-free guidance 4 by default",
    )
    kind.add_argument(
        "--kv",
        action="store_true",
        help="a checkpoint of the KV variant (Flux2KleinKVPipeline: reference K/V computed on the first step, reused)",
    )
    t.set_defaults(func=_tiny)

    v = sub.add_parser(
        "verify", help="torch fp32 vs ONNX Runtime per component at several shapes, and the final image vs diffusers"
    )
    v.add_argument(
        "--bundle",
        required=True,
        help="the bundle directory to check (with dynamic shapes: static-shape bundles are refused)",
    )
    reference = v.add_mutually_exclusive_group()
    reference.add_argument(
        "--checkpoint", help="the checkpoint the bundle was exported from: compare with torch and diffusers"
    )
    v.add_argument(
        "--transformer",
        metavar="FILE",
        help="with --checkpoint: the single-file transformer the bundle was converted with (convert --transformer)",
    )
    reference.add_argument(
        "--against",
        metavar="REFERENCE_BUNDLE",
        help="instead of --checkpoint: compare with another bundle of the same checkpoint (its fp32 export), in ONNX "
        "Runtime, one session at a time: per-component errors and the final image's PSNR",
    )
    v.add_argument(
        "--size",
        type=_side,
        help="image side in pixels: with --against, of the compared images (default 512); with --checkpoint, one "
        "image of that size instead of the two small default cases",
    )
    images = v.add_mutually_exclusive_group()
    images.add_argument("--no-images", action="store_true", help="skip the end-to-end images")
    images.add_argument(
        "--images-only",
        action="store_true",
        help="compare the final images only: skip the per-component comparisons (with --checkpoint, each holds the "
        "component in float32 and float64 and its ONNX Runtime session at once: about 4x its float32 weights)",
    )
    v.set_defaults(func=_verify)

    r = sub.add_parser("ranges", help="largest |activation| per module over a diffusers run, against the float16 range")
    r.add_argument("--checkpoint", required=True, help="the diffusers checkpoint to measure")
    r.add_argument("--steps", type=_at_least(1), default=2, help="denoising steps (default 2)")
    r.add_argument("--size", type=_side, default=64, help="image side in pixels, a multiple of 16 from 64 (default 64)")
    r.add_argument("--top", type=_at_least(1), default=40, help="rows to print (default 40)")
    r.set_defaults(func=_ranges)

    f = sub.add_parser("fixtures", help="run diffusers' pipeline and write the runtime's reference fixtures")
    f.add_argument("--checkpoint", required=True, help="the diffusers checkpoint to run")
    f.add_argument("--out", required=True, help="fixtures directory to write")
    f.add_argument("--force", action="store_true", help="replace an existing --out (once every case is written)")
    f.set_defaults(func=_fixtures)
    return p


def _at_least(low: int):
    """An argparse type: a whole number of at least `low`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: give a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}: give {low} or more")
        return value

    return parse


def _side(text: str) -> int:
    """An argparse type: an image side, a multiple of 16 pixels from 64 (diffusers' smallest
    image) up to 4096."""
    value = _at_least(64)(text)
    if value % 16 or value > 4096:
        raise argparse.ArgumentTypeError(f"{value}: give a multiple of 16 pixels, 64 to 4096")
    return value


def _seed(text: str) -> int:
    """An argparse type: a torch seed, 0 to 2**63 - 1."""
    value = _at_least(0)(text)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"{value}: give a seed below 2**63")
    return value


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        with stops_raised():
            if getattr(args, "checkpoint", None):
                from .hub import resolve_checkpoint

                # A Hub id (ORG/NAME) becomes its snapshot in the Hugging Face cache.
                args.checkpoint = str(resolve_checkpoint(args.checkpoint, getattr(args, "revision", None)))
            return args.func(args)
    except (KleinExportError, FileExistsError, FileNotFoundError) as e:
        print(f"klein-export: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as e:  # a path that is not a directory, a file that cannot be read or written
        where = f"{e.filename}: " if e.filename else ""
        print(f"klein-export: error: {where}{e.strerror or e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Stopped as e:  # SIGTERM, SIGHUP: as Ctrl-C
        print(f"klein-export: stopped by {e}; nothing was written", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:  # Ctrl-C: the partial output is already removed (atomic_directory)
        print("klein-export: interrupted; nothing was written", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
