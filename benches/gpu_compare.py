"""klein on CUDA against diffusers' `Flux2KleinPipeline` on the same GPU, in one run.

Same prompt, seed, size and step count for every run.
- klein: every repetition is a fresh `klein generate --device cuda --timings` process (after one
  untimed warm-up run); its stages are parsed as in compare.py. "generate" is text encoder + denoise
  + decode, without the graph loads.
- diffusers: one process per dtype; the pipeline is built once, run once untimed (cuDNN and
  kernel selection), then `--reps` times. Stages: `pipe.encode_prompt`, the transformer's forward per
  step, `pipe.vae.decode`, each timed with `torch.cuda.synchronize()`.
- Peak GPU memory: klein, the largest `used_memory` NVML reports for the klein process (polled every
  20 ms: what ONNX Runtime's arenas hold); diffusers, `torch.cuda.max_memory_reserved()` (what
  PyTorch's allocator holds) and the allocated peak.

`--random-init`: the checkpoint holds configs and the tokenizer only; diffusers' modules are built
from the configs with random weights on the GPU (for a host that cannot receive the weights; klein
then runs a bundle from `skeleton.py fill`). Speed does not depend on the weights; the images do,
so with `--random-init` they are not compared. Without it the checkpoint is loaded and each klein
bundle's image is compared with diffusers' (PSNR, as compare.py).

    python benches/gpu_compare.py --checkpoint CKPT --bundle fp16=BUNDLE [--bundle ...] \\
        --klein target/release/klein [--width 1024 --height 1024 --steps 4 --reps 3] \\
        [--dtype bf16 --dtype fp16] [--random-init] [--work DIR]
"""

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import (
    DEFAULT_PROMPT,
    fmt_ratio,
    fmt_s,
    generate_image,
    image_error,
    load_rgb,
    median,
    parse_klein_timings,
    print_table,
)


def diffusers_worker(spec: dict) -> None:
    import torch
    from diffusers import Flux2KleinPipeline

    dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[spec["dtype"]])
    device = spec["device"]
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ckpt = Path(spec["checkpoint"])
    t = time.perf_counter()
    if spec["random_init"]:
        from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
        from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

        torch.set_default_dtype(dtype)
        with torch.device(device):
            text_encoder = Qwen3ForCausalLM(Qwen3Config.from_pretrained(ckpt / "text_encoder"))
            transformer = Flux2Transformer2DModel.from_config(Flux2Transformer2DModel.load_config(ckpt / "transformer"))
            vae = AutoencoderKLFlux2.from_config(AutoencoderKLFlux2.load_config(ckpt / "vae"))
        torch.set_default_dtype(torch.float32)
        index = json.loads((ckpt / "model_index.json").read_text())
        pipe = Flux2KleinPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(ckpt / "scheduler"),
            vae=vae.eval(),
            text_encoder=text_encoder.eval(),
            tokenizer=AutoTokenizer.from_pretrained(ckpt / "tokenizer"),
            transformer=transformer.eval(),
            is_distilled=index.get("is_distilled", False),
        ).to(dtype)
    else:
        pipe = Flux2KleinPipeline.from_pretrained(ckpt, torch_dtype=dtype).to(device)
    sync()
    load_s = time.perf_counter() - t
    pipe.set_progress_bar_config(disable=True)

    stages = {"text encoder": [], "decode": [], "steps": []}

    def timed(fn, sink):
        def wrapper(*args, **kwargs):
            sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            sink.append(time.perf_counter() - start)
            return out

        return wrapper

    pipe.encode_prompt = timed(pipe.encode_prompt, stages["text encoder"])
    pipe.vae.decode = timed(pipe.vae.decode, stages["decode"])
    step_start = []

    def pre(module, args):
        sync()
        step_start.append(time.perf_counter())

    def post(module, args, out):
        sync()
        stages["steps"].append(time.perf_counter() - step_start[-1])

    pipe.transformer.register_forward_pre_hook(pre)
    pipe.transformer.register_forward_hook(post)

    runs = []
    for _rep in range(spec["reps"] + 1):  # the first is the untimed warm-up
        for sink in stages.values():
            sink.clear()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        t = time.perf_counter()
        image = generate_image(pipe, spec)
        sync()
        runs.append(
            {
                "generate": time.perf_counter() - t,
                "text encoder": sum(stages["text encoder"]),
                "steps": list(stages["steps"]),
                "denoise": sum(stages["steps"]),
                "decode": sum(stages["decode"]),
                "gpu reserved": torch.cuda.max_memory_reserved() if cuda else 0,
                "gpu allocated": torch.cuda.max_memory_allocated() if cuda else 0,
            }
        )
    image.save(spec["image"])
    result = {
        "load": load_s,
        "runs": runs[1:],
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if cuda else "none",
    }
    Path(spec["json"]).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def gpu_memory_poller(pid: int, peak: list, stop: threading.Event) -> None:
    """The largest NVML `used_memory` of process `pid` on any GPU, into `peak[0]` (bytes)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # no NVIDIA driver (a CPU smoke run): no figure
        print(f"no GPU memory figure: {e}", file=sys.stderr)
        return
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    while not stop.is_set():
        for h in handles:
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == pid and p.usedGpuMemory:
                    peak[0] = max(peak[0], p.usedGpuMemory)
        stop.wait(0.02)
    pynvml.nvmlShutdown()


def run_klein(cmd, log: Path) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    peak, stop = [0], threading.Event()
    poller = threading.Thread(target=gpu_memory_poller, args=(proc.pid, peak, stop))
    poller.start()
    out = proc.communicate()[0].decode("utf-8", errors="replace")
    wall = time.perf_counter() - start
    stop.set()
    poller.join()
    log.write_text(out, encoding="utf-8")
    return {"rc": proc.returncode, "wall": wall, "gpu": peak[0], "log": out}


def klein_batch(args, cmd, stem: Path) -> list:
    """One `klein generate --prompts` process of reps + 1 lines (the prompt numbered, so that each
    line encodes its own); the timings of every line after the first, the pipeline loaded and warm."""
    lines = [{"prompt": f"{args.prompt} #{i}", "seed": args.seed} for i in range(args.reps + 1)]
    prompts = Path(f"{stem}.jsonl")
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    seed = cmd.index("--seed")  # the lines carry the seed and the prompt
    batch = [c for i, c in enumerate(cmd) if c != args.prompt and i not in (seed, seed + 1)]
    batch += ["--prompts", str(prompts), "--out-dir", f"{stem}-out"]
    r = run_klein(batch, Path(f"{stem}.log"))
    if r["rc"] != 0:
        print(f"klein batch: exit {r['rc']}\n{r['log'][-3000:]}", file=sys.stderr)
        return []
    blocks = re.split(r"^\[\d+/\d+\] line .*$", r["log"], flags=re.M)[1:]
    runs = []
    for block in blocks[1:]:
        t = parse_klein_timings(block, args.steps)
        t.update(gpu=r["gpu"], load=0.0, generate=t["text encoder"] + t["denoise"] + t["decode"])
        print(f"klein batch line: {json.dumps({k: v for k, v in t.items() if k != 'raw'})}", flush=True)
        runs.append(t)
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--checkpoint", required=True, help="diffusers checkpoint directory (configs only with --random-init)"
    )
    p.add_argument("--bundle", action="append", default=[], metavar="NAME=DIR", help="a klein bundle; repeatable")
    p.add_argument(
        "--dtype", action="append", choices=["bf16", "fp16", "fp32"], help="diffusers dtype; repeatable (default bf16)"
    )
    p.add_argument(
        "--klein-batch",
        action="store_true",
        help="also run each bundle once in batch mode (--prompts), reps + 1 lines with numbered prompts: "
        "the lines after the first are warm",
    )
    p.add_argument("--no-diffusers", action="store_true", help="klein bundles only")
    p.add_argument(
        "--random-init", action="store_true", help="diffusers with random weights from the checkpoint's configs"
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--height", type=int, default=1024)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--klein", default="target/release/klein")
    p.add_argument("--klein-arg", action="append", default=[], help="an extra argument of klein generate; repeatable")
    p.add_argument("--work", help="directory for images, logs and JSON (default: a new temporary one)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run of this script")
    p.add_argument("--klein-device", help="klein's --device (default: --device)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        diffusers_worker(json.loads(Path(args.worker).read_text()))
        return 0
    work = Path(args.work or tempfile.mkdtemp(prefix="klein-gpu-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    failed = False
    rows, klein_images, results = [], {}, {}

    for name, bundle in (b.split("=", 1) for b in args.bundle):
        cmd = [
            args.klein, "generate", args.prompt, "--model", bundle, "--device", args.klein_device or args.device,
            "--seed", str(args.seed), "--width", str(args.width), "--height", str(args.height),
            "--steps", str(args.steps), "--timings",
            *args.klein_arg,
        ]  # fmt: skip
        runs = []
        for rep in range(args.reps + 1):  # the first is the untimed warm-up
            stem = work / f"klein-{name}-{rep}"
            r = run_klein([*cmd, "-o", f"{stem}.png"], Path(f"{stem}.log"))
            if r["rc"] != 0:
                print(f"klein {name} rep {rep}: exit {r['rc']}\n{r['log'][-3000:]}", file=sys.stderr)
                failed = True
                break
            t = parse_klein_timings(r["log"], args.steps)
            t.update(wall=r["wall"], gpu=r["gpu"], generate=t["text encoder"] + t["denoise"] + t["decode"])
            print(f"klein {name} rep {rep}: {json.dumps({k: v for k, v in t.items() if k != 'raw'})}", flush=True)
            runs.append(t)
            klein_images[name] = Path(f"{stem}.png")
        results[f"klein {name}"] = runs[1:]
        if args.klein_batch:
            results[f"klein {name} warm"] = klein_batch(args, cmd, work / f"klein-{name}-batch")

    for dtype in [] if args.no_diffusers else args.dtype or ["bf16"]:
        stem = work / f"diffusers-{dtype}"
        spec = dict(
            checkpoint=args.checkpoint, device=args.device, dtype=dtype, random_init=args.random_init,
            prompt=args.prompt, seed=args.seed, width=args.width, height=args.height, steps=args.steps, reps=args.reps,
            image=f"{stem}.png", json=f"{stem}.json",
        )  # fmt: skip
        Path(f"{stem}-spec.json").write_text(json.dumps(spec))
        c = subprocess.run([sys.executable, __file__, "--checkpoint", args.checkpoint, "--worker", f"{stem}-spec.json"])
        if c.returncode != 0:
            failed = True
            continue
        d = json.loads(Path(f"{stem}.json").read_text())
        print(f"diffusers {dtype}: {json.dumps(d)}", flush=True)
        for run in d["runs"]:
            run.update(load=d["load"], gpu=run["gpu reserved"])
        results[f"diffusers {dtype}"] = d["runs"]

    def med(runs, key):
        return median([r[key] for r in runs]) if runs else math.nan

    base = next((k for k in results if k.startswith("diffusers")), None)
    for key, runs in results.items():
        step = median([s for r in runs for s in r["steps"]]) if runs else math.nan
        row = [key, len(runs)] + [
            fmt_s(med(runs, k)) for k in ("load", "text encoder", "denoise", "decode", "generate")
        ]
        row += [fmt_s(step), f"{med(runs, 'gpu') / 2**30:.2f}" if runs else "-"]
        row.append(fmt_ratio(med(results[base], "generate"), med(runs, "generate")) if base else "-")
        rows.append(row)
    header = ["median of reps", "reps", "load (s)", "text encoder (s)", "denoise (s)", "decode (s)", "generate (s)"]
    header += ["step (s)", "peak GPU (GiB)", f"speed vs {base}"]
    print_table(header, rows)
    if not args.random_init:
        for dtype in args.dtype or ["bf16"]:
            ref = work / f"diffusers-{dtype}.png"
            for name, path in klein_images.items():
                if ref.exists():
                    e = image_error(load_rgb(path), load_rgb(ref))
                    print(f"klein {name} against diffusers {dtype}: PSNR {e['psnr']:.2f} dB, max {e['max']}")
    (work / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"work: {work}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
