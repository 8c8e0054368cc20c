"""A bundle run from Python: its graphs in ONNX Runtime and everything between them in numpy, as
Flux2KleinPipeline does it (transformers tokenizer, CPU torch noise, diffusers' scheduler). `verify`
and `verify --against` run bundles with it."""

from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from .errors import BundleError
from .int8_kernels import session_options, weights_7bit
from .manifest import read_manifest

# ONNX Runtime's names of the manifest's element types.
_ORT_TYPES = {
    "float32": "tensor(float)",
    "float16": "tensor(float16)",
    "bfloat16": "tensor(bfloat16)",
    "int64": "tensor(int64)",
}


def session(bundle, spec: dict) -> ort.InferenceSession:
    """A CPU session (2 threads) on the graph of the manifest entry `spec` (`graphs.*`), its inputs
    and outputs checked against the entry's: a graph that does not match its manifest (files swapped
    with their hashes rewritten, a hand-edited manifest) is a BundleError naming the file, not an
    error from ONNX Runtime when it runs. Its int8 weights run as the runtime runs them on this CPU
    (int8_kernels.py: converted to uint8 where 8-bit codes would saturate)."""
    opts = session_options(weights_7bit(spec), threads=2)
    path = Path(bundle) / spec["file"]
    try:
        sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's NoSuchFile, InvalidProtobuf, Fail...
        raise BundleError(f"{path}: ONNX Runtime cannot load it ({e})") from e
    problems = []
    sides = (
        ("input", sess.get_inputs(), spec.get("inputs", [])),
        ("output", sess.get_outputs(), spec.get("outputs", [])),
    )
    for kind, found, listed in sides:
        found = {t.name: (t.type, len(t.shape)) for t in found}
        listed = {t["name"]: (_ORT_TYPES.get(t["dtype"], t["dtype"]), len(t["shape"])) for t in listed}
        for name in sorted(found.keys() | listed.keys()):
            if found.get(name) != listed.get(name):
                want = "none" if name not in listed else f"{listed[name][0]} of rank {listed[name][1]}"
                got = "none" if name not in found else f"{found[name][0]} of rank {found[name][1]}"
                problems.append(f"{kind} {name}: manifest.json lists {want}, the graph has {got}")
    if problems:
        problems = "; ".join(problems)
        raise BundleError(f"{path}: the graph does not match manifest.json ({problems}); export the bundle again")
    return sess


def run_graph(bundle, spec: dict, feeds: dict) -> np.ndarray:
    """The first output of the graph of the manifest entry `spec` (`graphs.*`); its session is freed on return."""
    return session(bundle, spec).run(None, feeds)[0]


def latent_ids(h, w, t=0) -> torch.Tensor:
    """`[h*w, 4]` ids of an `h x w` latent grid at time offset `t`: rows `(t, y, x, 0)`."""
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack(
        [torch.full_like(ys, t).flatten(), ys.flatten(), xs.flatten(), torch.zeros_like(ys).flatten()], dim=1
    )


def text_ids(seq) -> torch.Tensor:
    """`[seq, 4]` ids of the prompt tokens: rows `(0, 0, 0, l)`."""
    return torch.stack([torch.zeros(seq, dtype=torch.int64)] * 3 + [torch.arange(seq)], dim=1)


def no_reference_feeds(manifest: dict, batch: int) -> dict:
    """A KV bundle's transformer inputs for a step without references (kv_cache.py): no reference
    tokens, an empty K/V cache. Nothing for other bundles."""
    if not manifest["model"].get("kv_cache"):
        return {}
    channels, n_axes = manifest["latents"]["channels"], len(manifest["transformer"]["axes_dims_rope"])
    kv = next(t for t in manifest["graphs"]["transformer"]["inputs"] if t["name"] == "cached_kv")
    layers, _, _, _, inner = kv["shape"]
    return {
        "ref_latents": np.zeros((batch, 0, channels), np.float32),
        "ref_ids": np.zeros((0, n_axes), np.int64),
        "cached_kv": np.zeros((layers, 2, batch, 0, inner), np.float32),
    }


def prompt_feeds(bundle, tok: dict, prompt: str) -> dict:
    """The text encoder's inputs for `prompt`, tokenised as the manifest's `tokenizer` section `tok` says."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(Path(bundle) / tok["file"]), pad_token=tok["pad_token"], padding_side=tok["padding_side"]
    )
    enc = tokenizer(
        [tok["prompt_prefix"] + prompt + tok["prompt_suffix"]],
        padding="max_length",
        truncation=True,
        max_length=tok["max_sequence_length"],
        add_special_tokens=tok["add_special_tokens"],
        return_tensors="np",
    )
    return {"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": enc["attention_mask"].astype(np.int64)}


def bundle_image(bundle, prompt, seed, width, height, steps=None) -> np.ndarray:
    """Text to image with the bundle: float image `[H, W, 3]` in [0, 255] (not rounded)."""
    latents = bundle_latents(bundle, prompt, seed, width, height, steps)
    image = run_graph(bundle, read_manifest(bundle)["graphs"]["vae_decoder"], {"latents": latents})
    return np.clip(image[0].transpose(1, 2, 0) / 2 + 0.5, 0, 1) * 255


def bundle_latents(bundle, prompt, seed, width, height, steps=None) -> np.ndarray:
    """Text to image with the bundle up to the VAE decoder: its input `[1, C, h, w]`."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    manifest = read_manifest(bundle)
    if manifest["model"].get("family") == "flux3":
        from .flux3_ort_pipeline import bundle_latents as flux3_latents

        return flux3_latents(bundle, prompt, seed, width, height, steps)
    graphs = manifest["graphs"]
    steps = steps or manifest["model"]["default_steps"]

    # 1. prompt -> embeddings [1, L, joint_dim]
    embeds = run_graph(bundle, graphs["text_encoder"], prompt_feeds(bundle, manifest["tokenizer"], prompt))
    txt_ids = text_ids(embeds.shape[1]).numpy()

    # 2. noise [1, C, h, w] -> packed [1, h*w, C]
    multiple, channels = manifest["latents"]["pixel_multiple"], manifest["latents"]["channels"]
    h, w = height // multiple, width // multiple
    generator = torch.Generator("cpu").manual_seed(seed)
    noise = torch.randn((1, channels, h, w), generator=generator, dtype=torch.float32).numpy()
    x = noise.reshape(1, channels, h * w).transpose(0, 2, 1).copy()
    img_ids = latent_ids(h, w).numpy()

    # 3. schedule
    sch = manifest["scheduler"]
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=sch["num_train_timesteps"],
        shift=sch["shift"],
        use_dynamic_shifting=sch["use_dynamic_shifting"],
        time_shift_type=sch["time_shift_type"],
    )
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=compute_empirical_mu(h * w, steps))
    sigmas = scheduler.sigmas.numpy().astype(np.float32)
    timesteps = scheduler.timesteps.numpy().astype(np.float32)

    # 4. denoise: x += (sigma_{i+1} - sigma_i) * v, float32
    transformer = session(bundle, graphs["transformer"])
    for i in range(steps):
        timestep = np.full((1,), timesteps[i] / np.float32(1000), np.float32)
        feeds = {"latents": x, "prompt_embeds": embeds, "timestep": timestep, "img_ids": img_ids, "txt_ids": txt_ids}
        feeds.update(no_reference_feeds(manifest, 1))
        v = transformer.run(None, feeds)[0][:, : h * w]
        x = (x + (sigmas[i + 1] - sigmas[i]) * v).astype(np.float32)

    # 5. [1, h*w, C] -> the decoder's input [1, C, h, w]
    return np.ascontiguousarray(x.transpose(0, 2, 1).reshape(1, channels, h, w))
