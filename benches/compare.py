"""klein against diffusers' `Flux2KleinPipeline` on one checkpoint, in one run.

Same prompt, seed, size, step count and thread count for every run. Each repetition of each
configuration is a fresh process (klein: the `klein` binary; diffusers: this script re-invoked as a
worker), so load times and peak resident memory (`ru_maxrss` of that child, read with `os.wait4`)
are per run. Repetitions are interleaved (rep 1 of every configuration, then rep 2, ...) so that a
slow spell of the machine hits all of them alike.

Per-stage seconds:
- klein: parsed from `klein generate --timings` (stderr). "load" is the sum of the graph loads
  (text encoder, transformer, VAE decoder: klein loads each on first use and releases the text
  encoder before the transformer). The step time is the median of per-step lines when klein prints
  them, else denoise / steps (a mean, marked `*`).
- diffusers: `from_pretrained` (load), `pipe.encode_prompt` (text encoder), the transformer's
  forward per step (forward pre/post hooks: the median of the steps), `pipe.vae.decode`.
- end to end: the child process's wall time, spawn to exit (what a user waits for: klein includes
  ONNX Runtime start-up and PNG writing, diffusers includes `import torch, diffusers`); "load +
  generate" is the same without process start-up and imports (diffusers: from_pretrained + the
  pipeline call; klein: the sum of its stages).

Also measured in the same run: the machine's fp32 matmul peak through ONNX Runtime (a one-MatMul
graph built with onnx.helper at the transformer's shapes, [tokens, dim] x [dim, 3*dim] by default,
same thread count, best of 7 runs after a 1 s warm-up), before every repetition and after the last; the table uses the
highest. (On the 2-vCPU VM this was written on, the same measurement gave 286 and 597 GFLOP/s less
than an hour apart: measure it beside the runs, never once and for all.)
The transformer step's achieved GFLOP/s is given as a fraction of that peak. FLOPs per step come
from the transformer's config.json: 2 * in * out * tokens for every linear layer (each with the
tokens that pass through it: image, text or both; modulation and timestep layers once) plus
4 * tokens^2 * dim per block for attention (QK^T and AV); the linear parameters counted are checked
against the 2-D weights in the checkpoint's safetensors headers.

Each run also reports its CPU seconds (`ru_utime + ru_stime`) and the CPUs that *other* processes
used meanwhile (busy time in /proc/stat minus the child's): a run beside a compiler or a test suite
is visible in the table. `--quiet-wait S` waits up to S seconds before each run for the rest of the
machine to fall under 0.2 CPUs.

Image error: PSNR (dB, uint8 RGB) and the share of pixels that differ of each klein bundle against
klein fp32 and against each diffusers run, plus diffusers bf16 against diffusers fp32.

Usage (from the repository root, in the export venv: `source scripts/python-env.sh`; the klein
binary built with `cargo build --release`):

    python benches/compare.py --checkpoint CKPT [--bundle BUNDLE_FP32] \\
        [--extra-bundle int8=BUNDLE_INT8 ...] [--diffusers-bf16 [auto|on|off]] [--no-diffusers-fp32] \\
        [--diffusers-free-text-encoder] [--prompt TEXT] [--seed 42] [--width 512 --height 512] [--steps 4] \\
        [--threads 2] [--reps 3] \\
        [--quiet-wait 60] [--work DIR] [--klein target/release/klein] [--peak-shape M,K,N] \\
        [--klein-cpu-cache DIR]

e.g. on the tiny checkpoint:

    klein-export tiny --out /tmp/bench-tiny
    klein-export convert --checkpoint /tmp/bench-tiny --out /tmp/bench-tiny-bundle
    python benches/compare.py --checkpoint /tmp/bench-tiny --bundle /tmp/bench-tiny-bundle \\
        --width 64 --height 64 --steps 2 --threads 2 --reps 2

Images, per-run JSON and logs go to --work (default: a new temporary directory, printed).
Exit status: 0 when every run succeeded, 1 otherwise (the table is printed with what ran).
"""

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_KLEIN = REPO / "target" / "release" / "klein"
DEFAULT_PROMPT = "a red fox in the snow, golden hour, photograph"
# Flux2KleinPipeline's default max_sequence_length: every prompt is padded to this many tokens.
TEXT_TOKENS = 512
# Image latents are 16x16 pixels per token (VAE factor 8, 2x2 patches).
PIXELS_PER_TOKEN_SIDE = 16


# --------------------------------------------------------------------------------------------
# diffusers worker: one generation in this (fresh) process, timings written as JSON.
# --------------------------------------------------------------------------------------------


def generate_image(pipe, spec: dict):
    """One text-to-image call of the pipeline with the spec's prompt, size, steps and seed (a CPU
    generator, as diffusers' docs seed it); the PIL image."""
    import torch

    return pipe(
        prompt=spec["prompt"],
        height=spec["height"],
        width=spec["width"],
        num_inference_steps=spec["steps"],
        guidance_scale=1.0,
        generator=torch.Generator("cpu").manual_seed(spec["seed"]),
        output_type="pil",
    ).images[0]


def diffusers_worker(spec: dict) -> None:
    t_import = time.perf_counter()
    import torch
    from diffusers import Flux2KleinPipeline

    threads = spec["threads"]
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    import_s = time.perf_counter() - t_import
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]

    t = time.perf_counter()
    pipe = Flux2KleinPipeline.from_pretrained(spec["checkpoint"], dtype=dtype)
    load_s = time.perf_counter() - t
    pipe.set_progress_bar_config(disable=True)

    encode_s, decode_s, steps = [], [], []

    def timed(fn, sink):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            sink.append(time.perf_counter() - start)
            return out

        return wrapper

    # The pipeline calls self.encode_prompt and self.vae.decode: instance attributes shadow both.
    pipe.encode_prompt = timed(pipe.encode_prompt, encode_s)
    freed = {}
    if spec.get("free_text_encoder"):
        pipe.encode_prompt = free_text_encoder_after(pipe, pipe.encode_prompt, freed)
    pipe.vae.decode = timed(pipe.vae.decode, decode_s)
    step_start = []
    pipe.transformer.register_forward_pre_hook(lambda module, args: step_start.append(time.perf_counter()))
    pipe.transformer.register_forward_hook(lambda module, args, out: steps.append(time.perf_counter() - step_start[-1]))

    t = time.perf_counter()
    image = generate_image(pipe, spec)
    call_s = time.perf_counter() - t
    image.save(spec["image"])
    result = {
        "import": import_s,
        "load": load_s,
        "text encoder": sum(encode_s),
        "steps": steps,
        "denoise": sum(steps),
        "decode": sum(decode_s),
        "load + generate": load_s + call_s,
        **freed,
        "torch": torch.__version__,
        "torch threads": torch.get_num_threads(),
        "torch cpu capability": torch.backends.cpu.get_cpu_capability(),
    }
    Path(spec["json"]).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def free_text_encoder_after(pipe, encode, sink: dict):
    """`encode` (the pipeline's encode_prompt), then the text encoder dropped from the pipeline (no
    other reference holds it: its weights are freed), as diffusers' low-memory examples do by
    encoding first and building the pipeline with `text_encoder=None`. The guidance-free klein call
    encodes once and never uses the encoder again. Records the resident memory before and after
    and the seconds the release took (counted in the process's wall time, not in "text encoder")."""
    import gc
    import weakref

    def wrapper(*args, **kwargs):
        out = encode(*args, **kwargs)
        start = time.perf_counter()
        sink["rss before freeing the text encoder"] = resident_bytes()
        encoder = weakref.ref(pipe.text_encoder)
        pipe.text_encoder = None
        gc.collect()
        if encoder() is not None:
            raise RuntimeError("--diffusers-free-text-encoder: something still holds the text encoder")
        sink["rss after freeing the text encoder"] = resident_bytes()
        sink["freeing the text encoder"] = time.perf_counter() - start
        return out

    return wrapper


def resident_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


# --------------------------------------------------------------------------------------------
# Child processes with their own peak RSS.
# --------------------------------------------------------------------------------------------


def busy_cpu_seconds() -> float:
    """CPU seconds every process on the machine has spent busy since boot (/proc/stat, all CPUs)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(max_wait: float, threshold: float = 0.2, window: float = 2.0) -> float:
    """Waits (up to `max_wait` s) until the rest of the machine uses under `threshold` CPUs over a
    `window`; returns the last measured load in CPUs."""
    deadline = time.monotonic() + max_wait
    while True:
        before = busy_cpu_seconds()
        time.sleep(window)
        load = (busy_cpu_seconds() - before) / window
        if load < threshold or time.monotonic() >= deadline:
            return load


def run_child(cmd, log_path: Path, env=None) -> dict:
    """Runs `cmd` to completion. Returns its exit code, wall seconds, peak RSS (bytes, `ru_maxrss`
    of this child alone), CPU seconds, the CPUs the *other* processes of the machine used meanwhile
    (busy time in /proc/stat minus the child's), and its output lines with their arrival times
    (seconds since spawn)."""
    lines = []
    busy_before = busy_cpu_seconds()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)

    def read():
        for raw in proc.stdout:
            lines.append((time.perf_counter() - start, raw.decode("utf-8", errors="replace").rstrip("\n")))

    reader = threading.Thread(target=read)
    reader.start()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    busy = busy_cpu_seconds() - busy_before
    reader.join()
    proc.stdout.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    cpu = usage.ru_utime + usage.ru_stime
    log_path.write_text("".join(f"[{t:8.3f}] {line}\n" for t, line in lines), encoding="utf-8")
    return {
        "rc": proc.returncode,
        "wall": wall,
        "rss": usage.ru_maxrss * 1024,  # Linux reports KiB
        "cpu": cpu,
        "others": max(0.0, busy - cpu) / wall,
        "lines": lines,
        "log": "\n".join(line for _, line in lines),
    }


TIMING_LINE = re.compile(r"^\s*([A-Za-z][A-Za-z0-9 _-]*?)\s*:\s+([0-9]+(?:\.[0-9]+)?)\s*s\s*$")


def parse_klein_timings(text: str, steps: int) -> dict:
    """`--timings` lines (`{label:>20}: {secs:8.3} s`) to the table's stages."""
    stages = {}
    for line in text.splitlines():
        m = TIMING_LINE.match(line)
        if m:
            stages.setdefault(m.group(1).strip(), []).append(float(m.group(2)))
    loads = [v for k, vs in stages.items() if k.startswith("load") for v in vs]
    step_lines = [v for k, vs in stages.items() if re.fullmatch(r"step \d+", k) for v in vs]
    # `denoise steps: 2.49, 2.40, 2.21 s` (one line, every step's seconds)
    listed = re.search(r"denoise steps: ([0-9., ]+) s", text)
    if listed and not step_lines:
        step_lines = [float(v) for v in listed.group(1).split(",")]
    denoise = sum(stages.get("denoise", [math.nan]))
    out = {
        "load": sum(loads) if loads else math.nan,
        "text encoder": sum(stages.get("encode prompt", [math.nan])),
        "denoise": denoise,
        "decode": sum(stages.get("decode", [math.nan])),
        "load + generate": sum(v for k, vs in stages.items() if not re.fullmatch(r"step \d+", k) for v in vs),
        "raw": stages,
    }
    if step_lines:
        out["steps"] = step_lines
        out["step is mean"] = False
    else:
        out["steps"] = [denoise / steps] * steps
        out["step is mean"] = True
    return out


# --------------------------------------------------------------------------------------------
# FLOPs and the ONNX Runtime matmul peak.
# --------------------------------------------------------------------------------------------


def transformer_flops(config: dict, image_tokens: int, text_tokens: int) -> dict:
    """FLOPs of one transformer forward (batch 1) from Flux2Transformer2DModel's config.json.

    Linear layers: 2 * in * out per token that passes through them. Attention: QK^T and AV,
    2 * T^2 * dim each, over the joint sequence T = text + image tokens, in every block.
    """
    d = config["num_attention_heads"] * config["attention_head_dim"]
    m = int(d * config.get("mlp_ratio", 3.0))
    in_ch = config["in_channels"]
    out_ch = config.get("out_channels") or in_ch
    patch = config.get("patch_size", 1)
    joint = config["joint_attention_dim"]
    t_ch = config.get("timestep_guidance_channels", 256)
    n_double, n_single = config["num_layers"], config["num_single_layers"]
    total = image_tokens + text_tokens
    # (in, out, tokens, count)
    linears = [
        (in_ch, d, image_tokens, 1),  # x_embedder
        (joint, d, text_tokens, 1),  # context_embedder
        (t_ch, d, 1, 1),  # time embedding linear_1
        (d, d, 1, 1),  # time embedding linear_2
        (d, 6 * d, 1, 2),  # double_stream_modulation_img / _txt (2 parameter sets x shift/scale/gate)
        (d, 3 * d, 1, 1),  # single_stream_modulation
        (d, 2 * d, 1, 1),  # norm_out (AdaLayerNormContinuous)
        (d, patch * patch * out_ch, image_tokens, 1),  # proj_out
    ]
    for stream_tokens in (image_tokens, text_tokens):  # double blocks: image and text streams
        linears += [
            (d, d, stream_tokens, 4 * n_double),  # to_q/k/v/out, add_q/k/v_proj/to_add_out
            (d, 2 * m, stream_tokens, n_double),  # ff(_context).linear_in (SwiGLU: 2 x hidden)
            (m, d, stream_tokens, n_double),  # ff(_context).linear_out
        ]
    linears += [
        (d, 3 * d + 2 * m, total, n_single),  # to_qkv_mlp_proj
        (d + m, d, total, n_single),  # to_out
    ]
    linear_flops = sum(2 * i * o * t * c for i, o, t, c in linears)
    params = sum(i * o * c for i, o, _, c in linears)
    attention_flops = 4 * total * total * d * (n_double + n_single)
    return {
        "linear": linear_flops,
        "attention": attention_flops,
        "total": linear_flops + attention_flops,
        "linear params": params,
        "dim": d,
        "tokens": total,
    }


def checkpoint_linear_params(transformer_dir: Path):
    """Parameters of the 2-D weights in the checkpoint's safetensors headers (no tensor is read)."""
    total = 0
    files = sorted(transformer_dir.glob("*.safetensors"))
    if not files:
        return None
    for f in files:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__" and len(info["shape"]) == 2:
                total += math.prod(info["shape"])
    return total


def ort_matmul_peak(m: int, k: int, n: int, threads: int, runs: int = 7) -> dict:
    """GFLOP/s of one fp32 [m, k] x [k, n] MatMul (weights as an initializer) in ONNX Runtime."""
    import numpy as np
    import onnxruntime as ort

    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array((rng.standard_normal((k, n), dtype=np.float32) / math.sqrt(k)), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["A", "W"], ["C"])],
        "matmul_peak",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("C", TensorProto.FLOAT, [m, n])],
        initializer=[weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    a = rng.standard_normal((m, k), dtype=np.float32)
    # Warm up for at least a second (and two runs): a CPU that was idle may still be clocking up.
    warm_until = time.perf_counter() + 1.0
    for i in range(1_000_000):
        session.run(None, {"A": a})
        if i >= 1 and time.perf_counter() > warm_until:
            break
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, {"A": a})
        times.append(time.perf_counter() - start)
    flops = 2 * m * k * n
    return {
        "shape": (m, k, n),
        "best s": min(times),
        "median s": statistics.median(times),
        "peak gflops": flops / min(times) / 1e9,
        "median gflops": flops / statistics.median(times) / 1e9,
        "ort": ort.__version__,
    }


# --------------------------------------------------------------------------------------------
# Images.
# --------------------------------------------------------------------------------------------


def load_rgb(path: Path):
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), dtype=np.uint8)


def image_error(a, b) -> dict:
    import numpy as np

    if a.shape != b.shape:
        return {"psnr": math.nan, "differ": math.nan, "max": math.nan}
    diff = np.abs(a.astype(np.int32) - b.astype(np.int32))
    mse = float(np.mean(diff.astype(np.float64) ** 2))
    psnr = math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)
    pixel_differs = np.any(diff > 0, axis=-1)
    return {"psnr": psnr, "differ": float(np.mean(pixel_differs)) * 100, "max": int(diff.max())}


# --------------------------------------------------------------------------------------------
# The benchmark.
# --------------------------------------------------------------------------------------------


def median(values):
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def fmt_s(v):
    return "-" if v is None or math.isnan(v) else f"{v:.3f}"


def fmt_ratio(a, b):
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return "-"
    return f"{a / b:.2f}"


def print_table(header, rows, out=sys.stdout):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]

    def line(r):
        return "  ".join(str(c).ljust(widths[0]) if i == 0 else str(c).rjust(widths[i]) for i, c in enumerate(r))

    print(line(header), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for r in rows:
        print(line(r), file=out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--checkpoint", required=True, help="diffusers checkpoint directory")
    p.add_argument(
        "--bundle",
        help="klein fp32 bundle of that checkpoint (leave out where it cannot be stored or run beside the rest, "
        "as for the full-size 4B on a 24 GB machine: the image errors against klein fp32 are then not printed)",
    )
    p.add_argument(
        "--extra-bundle",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="another bundle of the same checkpoint (fp16, int8, ...); repeatable",
    )
    p.add_argument(
        "--diffusers-bf16",
        nargs="?",
        const="on",
        default="auto",
        choices=("auto", "on", "off"),
        help="also run diffusers in bfloat16: auto (the default) where the CPU has bf16 units (AVX512-BF16 or AMX)",
    )
    p.add_argument(
        "--no-diffusers-fp32",
        action="store_true",
        help="skip diffusers fp32 (at sizes where its peak memory would not fit the machine; say so with the figures)",
    )
    p.add_argument(
        "--diffusers-free-text-encoder",
        action="store_true",
        help="free diffusers' text encoder once the prompt is encoded (at sizes where its weights and the "
        "decoder's activations would not fit the machine together; the resident memory before and after "
        "is printed per run)",
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--height", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="klein --threads and torch.set_num_threads")
    p.add_argument("--reps", type=int, default=3, help="fresh-process repetitions of every configuration")
    p.add_argument(
        "--klein",
        default=os.environ.get("KLEIN_AVX2_HOST_BIN", str(DEFAULT_KLEIN)),
        help="the klein binary (default: target/release/klein, or its masked copy under benches/avx2-host.sh)",
    )
    p.add_argument("--work", help="directory for images, logs and JSON (default: a new temporary one)")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=0,
        metavar="SECONDS",
        help="before each run, wait up to this long for the other processes to use under 0.2 CPUs",
    )
    p.add_argument(
        "--klein-cpu-cache",
        metavar="DIR",
        help="run the --extra-bundle bundles with --cpu-cache DIR (the fp32 bundle without); one untimed run "
        "per bundle fills the cache first (its loads printed)",
    )
    p.add_argument(
        "--warm-up",
        action="store_true",
        help="before every timed run, one untimed run of the same configuration (its image and JSON "
        "overwritten by the timed one), so that each reads its weights from the page cache; without it a "
        "run finds whatever the run before it left there (diffusers bf16 the checkpoint that diffusers "
        "fp32 has just read, klein its files pushed out by diffusers)",
    )
    p.add_argument("--peak-shape", help="M,K,N of the peak MatMul (default: tokens,dim,3*dim of the transformer)")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:  # one diffusers run in this fresh process (see run_child)
        diffusers_worker(json.loads(argv[1]))
        return 0
    args = p.parse_args(argv)

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="klein-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = Path(args.checkpoint).resolve()
    bundles = [("fp32", Path(args.bundle).resolve())] if args.bundle else []
    for item in args.extra_bundle:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            p.error(f"--extra-bundle {item!r}: expected NAME=DIR")
        if name == "fp32":
            p.error(f"--extra-bundle {item!r}: the name fp32 is --bundle's; choose another")
        bundles.append((name, Path(path).resolve()))
    if not bundles:
        p.error("no klein bundle: give --bundle, --extra-bundle or both")
    for _, b in bundles:
        if not (b / "manifest.json").is_file():
            p.error(f"{b}: not a klein bundle (no manifest.json)")
    if not Path(args.klein).is_file():
        p.error(f"{args.klein}: no klein binary (cargo build --release)")
    if patched_copies() and "/avx2-host/" not in str(Path(args.klein).resolve()):
        p.error(
            f"{args.klein}: under benches/avx2-host.sh on this host only the copies made by "
            "benches/avx2_patch.py are masked; use its copy of klein ($KLEIN_AVX2_HOST_BIN)"
        )
    isa = host_isa()
    bf16_units = bool({"avx512_bf16", "amx_bf16"} & set(isa))
    run_bf16 = args.diffusers_bf16 == "on" or (args.diffusers_bf16 == "auto" and bf16_units)
    diffusers_runs = ([] if args.no_diffusers_fp32 else ["fp32"]) + (["bf16"] if run_bf16 else [])
    if not diffusers_runs:
        p.error("no diffusers run left: drop --no-diffusers-fp32 or run bf16")
    # A private copy: a `cargo build` elsewhere must not swap the binary between repetitions.
    # (A masked copy stays in a directory named avx2-host, where avx2_host.c answers its cpuid.)
    klein = work / "avx2-host" / "klein-under-test" if patched_copies() else work / "klein-under-test"
    klein.parent.mkdir(exist_ok=True)
    shutil.copy2(args.klein, klein)

    config = json.loads((checkpoint / "transformer" / "config.json").read_text())
    lat_h, lat_w = args.height // PIXELS_PER_TOKEN_SIDE, args.width // PIXELS_PER_TOKEN_SIDE
    width, height = lat_w * PIXELS_PER_TOKEN_SIDE, lat_h * PIXELS_PER_TOKEN_SIDE
    flops = transformer_flops(config, lat_h * lat_w, TEXT_TOKENS)
    ckpt_params = checkpoint_linear_params(checkpoint / "transformer")

    print(f"work directory: {work}")
    print(f"checkpoint: {checkpoint}")
    for name, b in bundles:
        print(f"klein bundle {name}: {b}")
    print(
        f'prompt: "{args.prompt}", seed {args.seed}, {width}x{height}, {args.steps} steps, '
        f"{args.threads} threads, {args.reps} reps"
    )
    print(f"machine: {os.cpu_count()} CPUs, {_meminfo_gb()}, {cpu_model()}")
    masked = ""
    if masked_to_avx2():
        how = "ONNX Runtime's and klein's cpuid patched, torch's ATEN_CPU_CAPABILITY"
        how = how if patched_copies() else "CPUID faulting"
        masked = f" (masked to an AVX2 host by benches/avx2-host.sh: {how})"
    print(f"instruction sets: {', '.join(isa) or 'none of those looked for'}{masked}")
    why = "the CPU has bf16 units" if bf16_units else "no bf16 units: diffusers' fastest CPU setting here is fp32"
    print(f"diffusers bf16: {'run' if run_bf16 else 'not run'} ({why}; --diffusers-bf16 {args.diffusers_bf16})")
    if args.no_diffusers_fp32:
        print("diffusers fp32: not run (--no-diffusers-fp32)")
    if args.diffusers_free_text_encoder:
        print("diffusers: text encoder freed once the prompt is encoded (--diffusers-free-text-encoder)")
    built = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(Path(args.klein).stat().st_mtime))
    print(f"klein binary: {args.klein} (built {built}), copied to {klein}")
    warm = "each timed run follows an untimed one of the same configuration (--warm-up)"
    print(f"page cache: {warm if args.warm_up else 'as the run before left it (no --warm-up)'}")

    # 1. The ONNX Runtime fp32 matmul peak: before every repetition and after the last one (on a
    # shared or virtual machine the attainable peak moves: hypervisor placement, other tenants). The
    # table uses the highest measurement, the conservative choice for "fraction of peak".
    if args.peak_shape:
        pm, pk, pn = (int(x) for x in args.peak_shape.split(","))
    else:
        pm, pk, pn = flops["tokens"], flops["dim"], 3 * flops["dim"]
    peaks = []

    def measure_peak(when):
        if args.quiet_wait:
            wait_for_quiet(args.quiet_wait)
        r = ort_matmul_peak(pm, pk, pn, args.threads)
        peaks.append(r)
        print(
            f"ORT {r['ort']} fp32 MatMul [{pm}, {pk}] x [{pk}, {pn}], {args.threads} threads, {when}: "
            f"best {r['best s'] * 1e3:.1f} ms = {r['peak gflops']:.1f} GFLOP/s (median {r['median gflops']:.1f})",
            flush=True,
        )

    # 2. Fresh-process runs, repetitions interleaved.
    results = {f"diffusers {d}": [] for d in diffusers_runs}
    results.update({f"klein {name}": [] for name, _ in bundles})
    images = {key: [] for key in results}
    failed = False
    child_env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))

    def klein_cmd(bundle, stem, extra):
        return [
            str(klein), "generate", args.prompt, "--model", str(bundle), "--seed", str(args.seed),
            "--width", str(width), "--height", str(height), "--steps", str(args.steps),
            "--threads", str(args.threads), "--timings", "-o", f"{stem}.png", *extra,
        ]  # fmt: skip

    def warm_up(key, cmd, stem, env):
        """The untimed run before a timed one (--warm-up); False when it failed (its log printed)."""
        c = run_child(cmd, Path(f"{stem}-warm-up.log"), env=env)
        if c["rc"] != 0:
            print(f"{key} warm-up: exit {c['rc']}; log {stem}-warm-up.log:\n{c['log'][-2000:]}", file=sys.stderr)
        return c["rc"] == 0

    cache_args = ["--cpu-cache", str(Path(args.klein_cpu_cache).resolve())] if args.klein_cpu_cache else []
    for name, bundle in [b for b in bundles if b[0] != "fp32"] if cache_args else []:
        stem = work / f"klein-{name}-cache-fill"
        c = run_child(klein_cmd(bundle, stem, cache_args), Path(f"{stem}.log"))
        loads = ", ".join(" ".join(line.split()) for _, line in c["lines"] if line.strip().startswith("load "))
        print(f"klein {name}: CPU cache filled (exit {c['rc']}, {c['wall']:.1f} s wall; {loads})", flush=True)
        failed = failed or c["rc"] != 0
    for rep in range(1, args.reps + 1):
        measure_peak(f"before rep {rep}")
        for d in diffusers_runs:
            key = f"diffusers {d}"
            stem = work / f"diffusers-{d}-rep{rep}"
            spec = dict(
                checkpoint=str(checkpoint),
                dtype=d,
                prompt=args.prompt,
                seed=args.seed,
                width=width,
                height=height,
                steps=args.steps,
                threads=args.threads,
                image=f"{stem}.png",
                json=f"{stem}.json",
                free_text_encoder=args.diffusers_free_text_encoder,
            )
            cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
            if args.warm_up:
                failed |= not warm_up(key, cmd, stem, child_env)
            quiet = wait_for_quiet(args.quiet_wait) if args.quiet_wait else math.nan
            c = run_child(cmd, Path(f"{stem}.log"), env=child_env)
            if c["rc"] != 0:
                print(f"{key} rep {rep}: exit {c['rc']}; log {stem}.log:\n{c['log'][-2000:]}", file=sys.stderr)
                failed = True
                continue
            r = json.loads(Path(f"{stem}.json").read_text())
            r.update({k: c[k] for k in ("wall", "rss", "cpu", "others")}, **{"step is mean": False, "quiet": quiet})
            results[key].append(r)
            images[key].append(Path(f"{stem}.png"))
            report_run(key, rep, r)
        for name, bundle in bundles:
            key = f"klein {name}"
            stem = work / f"klein-{name}-rep{rep}"
            cmd = klein_cmd(bundle, stem, cache_args if name != "fp32" else [])
            if args.warm_up:
                failed |= not warm_up(key, cmd, stem, None)
            quiet = wait_for_quiet(args.quiet_wait) if args.quiet_wait else math.nan
            c = run_child(cmd, Path(f"{stem}.log"))
            if c["rc"] != 0:
                print(f"{key} rep {rep}: exit {c['rc']}; log {stem}.log:\n{c['log'][-2000:]}", file=sys.stderr)
                failed = True
                continue
            r = parse_klein_timings(c["log"], args.steps)
            r.update(
                {k: c[k] for k in ("wall", "rss", "cpu", "others")}, quiet=quiet, **klein_phases(c["lines"], c["wall"])
            )
            results[key].append(r)
            images[key].append(Path(f"{stem}.png"))
            report_run(key, rep, r)

    measure_peak("after the runs")
    peak = max(peaks, key=lambda r: r["peak gflops"])

    # 3. The table.
    runs = [k for k in results if results[k]]

    def med(key, field):
        return median([r.get(field, math.nan) for r in results[key]])

    def step_med(key):
        return median([median(r["steps"]) for r in results[key]])

    rows_spec = [
        ("load", lambda k: med(k, "load")),
        ("text encoder", lambda k: med(k, "text encoder")),
        ("denoise step (median)", step_med),
        ("denoise, all steps", lambda k: med(k, "denoise")),
        ("VAE decode", lambda k: med(k, "decode")),
        ("load + generate", lambda k: med(k, "load + generate")),
        ("end to end (process)", lambda k: med(k, "wall")),
        (
            "  start-up (klein: to 1st line; diffusers: imports)",
            lambda k: med(k, "startup") if k.startswith("klein") else med(k, "import"),
        ),
        ("  after generation (klein: to exit)", lambda k: med(k, "finish")),
        ("peak RSS (GiB)", lambda k: med(k, "rss") / 2**30),
        ("CPU seconds of the process", lambda k: med(k, "cpu")),
        ("other processes' load (CPUs)", lambda k: med(k, "others")),
    ]
    values = {label: {k: fn(k) for k in runs} for label, fn in rows_spec}
    klein_runs = [k for k in runs if k.startswith("klein")]
    diff_runs = [k for k in runs if k.startswith("diffusers")]
    ratio_cols = [(kr, dr) for dr in diff_runs for kr in klein_runs]
    header = ["seconds, median of reps"] + runs + [f"{kr.split()[1]}/diff {dr.split()[1]}" for kr, dr in ratio_cols]
    rows = []
    for label, _ in rows_spec:
        v = values[label]
        cells = []
        for k in runs:
            cell = f"{v[k]:.2f}" if "RSS" in label or "CPU" in label else fmt_s(v[k])
            if (
                label.startswith("denoise step")
                and k.startswith("klein")
                and any(r["step is mean"] for r in results[k])
            ):
                cell += "*"
            cells.append(cell)
        ratios = (
            [fmt_ratio(v[kr], v[dr]) for kr, dr in ratio_cols] if "load (CPUs)" not in label else [""] * len(ratio_cols)
        )
        rows.append([label] + cells + ratios)
    gflops_row = ["step GFLOP/s"]
    frac_row = ["step / ORT matmul peak"]
    for k in runs:
        s = values["denoise step (median)"][k]
        g = flops["total"] / s / 1e9 if s and not math.isnan(s) else math.nan
        gflops_row.append("-" if math.isnan(g) else f"{g:.1f}")
        frac_row.append("-" if math.isnan(g) else f"{100 * g / peak['peak gflops']:.0f}%")
    rows += [gflops_row + [""] * len(ratio_cols), frac_row + [""] * len(ratio_cols)]
    print()
    print_table(header, rows)
    if any(r.get("step is mean") for k in klein_runs for r in results[k]):
        print("* klein prints no per-step times: denoise / steps (a mean, not a median)")
    print("ratios are klein time (or RSS) / diffusers; below 1 means klein is faster (or smaller)")
    print(
        f"transformer FLOPs per step: {flops['total'] / 1e9:.1f} GFLOP "
        f"(linear {flops['linear'] / 1e9:.1f}, attention {flops['attention'] / 1e9:.1f}) for "
        f"{flops['tokens']} tokens ({lat_h * lat_w} image + {TEXT_TOKENS} text); linear params counted "
        f"{flops['linear params'] / 1e6:.1f} M"
        + (f", 2-D weights in the checkpoint {ckpt_params / 1e6:.1f} M" if ckpt_params else "")
    )
    measured = ", ".join(f"{r['peak gflops']:.0f}" for r in peaks)
    print(
        f"ORT fp32 matmul peak: {peak['peak gflops']:.1f} GFLOP/s "
        f"([{pm}, {pk}] x [{pk}, {pn}], {args.threads} threads; "
        f"highest of {len(peaks)} measurements: {measured})"
    )
    for k in runs:
        walls = ", ".join(f"{r['wall']:.1f}" for r in results[k])
        rss = ", ".join(f"{r['rss'] / 2**30:.2f}" for r in results[k])
        others = ", ".join(f"{r['others']:.2f}" for r in results[k])
        print(
            f"  {k}: end to end per rep [{walls}] s, peak RSS per rep [{rss}] GiB, "
            f"other processes' load [{others}] CPUs"
        )

    if diff_runs:
        fastest = min(diff_runs, key=lambda k: values["end to end (process)"][k])
        wall = values["end to end (process)"][fastest]
        print(f"fastest diffusers setting here: {fastest} ({wall:.1f} s end to end); klein's speed against it:")
        for k in klein_runs:
            print(f"  {k}: {wall / values['end to end (process)'][k]:.2f}x")

    # 4. Image error.
    print()
    ref = {k: load_rgb(images[k][0]) for k in runs}
    for k in runs:
        others = [load_rgb(path) for path in images[k][1:]]
        same = all(o.shape == ref[k].shape and (o == ref[k]).all() for o in others)
        if not same:
            print(f"note: {k}: the repetitions' images differ")
    err_rows = []
    pairs = [(kr, "klein fp32") for kr in klein_runs if kr != "klein fp32" and "klein fp32" in ref]
    pairs += [(kr, dr) for dr in diff_runs for kr in klein_runs]
    if "diffusers fp32" in ref and "diffusers bf16" in ref:
        pairs.append(("diffusers bf16", "diffusers fp32"))
    for a, b in pairs:
        e = image_error(ref[a], ref[b])
        psnr = "inf" if math.isinf(e["psnr"]) else f"{e['psnr']:.2f}"
        err_rows.append([f"{a} vs {b}", psnr, f"{e['differ']:.2f}", str(e["max"])])
    if err_rows:
        print_table(["image error (rep 1, same seed)", "PSNR dB", "pixels differing %", "max level diff"], err_rows)
    return 1 if failed else 0


def klein_phases(lines, wall) -> dict:
    """Start-up (spawn to the first stderr line, `seed: ...`, printed once the bundle is opened) and
    the time after generation (the `device:` line, printed when the images are made, to exit:
    timings, PNG encoding and writing, process teardown)."""
    first = lines[0][0] if lines else math.nan
    done = next((t for t, line in lines if line.startswith("device:")), math.nan)
    return {"startup": first, "finish": wall - done}


def report_run(key, rep, r):
    print(
        f"{key} rep {rep}: {r['wall']:.1f} s, peak RSS {r['rss'] / 2**30:.2f} GiB, {r['cpu']:.1f} CPU s, "
        f"other processes {r['others']:.2f} CPUs"
        + ("" if math.isnan(r.get("quiet", math.nan)) else f" (before: {r['quiet']:.2f})")
        + (f", torch kernels {r['torch cpu capability']}" if "torch cpu capability" in r else "")
        + (
            f"; text encoder freed in {r['freeing the text encoder']:.2f} s, resident "
            f"{r['rss before freeing the text encoder'] / 2**30:.2f} -> "
            f"{r['rss after freeing the text encoder'] / 2**30:.2f} GiB"
            if "freeing the text encoder" in r
            else ""
        ),
        flush=True,
    )


# The instruction sets that decide which kernels torch and ONNX Runtime pick.
ISA_FLAGS = ("fma", "avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


# What benches/avx2-host.sh leaves of them (it masks CPUID for this process and its children).
AVX2_HOST_FLAGS = ("fma", "avx2")


def host_isa() -> list:
    """The ISA_FLAGS the libraries see: this CPU's, from /proc/cpuinfo (empty elsewhere), less what
    benches/avx2-host.sh masks when it runs this script."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    if masked_to_avx2():
        flags = [f for f in flags if f in AVX2_HOST_FLAGS]
    return [f for f in ISA_FLAGS if f in flags]


def masked_to_avx2() -> bool:
    return os.environ.get("KLEIN_BENCH_ISA_MASK") == "avx2" and "libavx2_host.so" in os.environ.get("LD_PRELOAD", "")


def patched_copies() -> bool:
    """Whether benches/avx2-host.sh masks only the copies it patched (a host without CPUID faulting)."""
    return masked_to_avx2() and os.environ.get("AVX2_HOST_PATCHED") == "1"


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "CPU model unknown"
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")


def _meminfo_gb() -> str:
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())

        def kb(key):
            return int(info[key].split()[0])

        return f"{kb('MemTotal') / 2**20:.1f} GiB RAM, {kb('MemAvailable') / 2**20:.1f} GiB available"
    except (OSError, KeyError, ValueError):
        return "memory unknown"


if __name__ == "__main__":
    sys.exit(main())
