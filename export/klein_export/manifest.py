"""Builds, writes and reads `manifest.json` (schema in onnx/README.md)."""

import hashlib
import json
from pathlib import Path

from . import FORMAT_VERSION, __version__
from .checkpoint import DEFAULT_OUT_LAYERS
from .contract import COMPONENTS
from .errors import BundleError
from .jsonfile import read_json
from .onnx_export import OPSET

MANIFEST = "manifest.json"

MIN_ONNXRUNTIME_VERSION = "1.31.0"
# Flux2KleinPipeline's default; a checkpoint's own are Checkpoint.text_encoder_out_layers
HIDDEN_LAYERS = DEFAULT_OUT_LAYERS

# diffusers pipelines/flux2/pipeline_flux2_klein.py compute_empirical_mu
EMPIRICAL_MU = {"a1": 8.73809524e-05, "b1": 1.89833333, "a2": 0.00016927, "b2": 0.45666666, "seq_len_threshold": 4300}
# diffusers pipelines/flux2/image_processor.py Flux2ImageProcessor.check_image_input / _resize_to_target_area
REFERENCES = {"min_side": 64, "max_aspect_ratio": 8, "max_area": 1024 * 1024, "time_offset_scale": 10}


def file_entry(path: Path) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def source_file(path: Path) -> dict:
    """What a manifest records of a file the bundle was exported from: its name and sha256."""
    return {"file": path.name, "sha256": file_entry(path)["sha256"]}


def _versions() -> dict:
    import diffusers
    import onnx
    import torch
    import transformers

    return {
        "name": "klein-export",
        "version": __version__,
        "opset": OPSET,
        "torch": torch.__version__.split("+")[0],
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
    }


# The manifest sections that describe the model's architecture: what a graph, a LoRA, a prompt
# cache entry or a reference bundle must agree with.
ARCHITECTURE = ("text_encoder", "transformer", "vae", "latents")


def architecture(ckpt) -> dict:
    """The manifest's ARCHITECTURE sections, from the checkpoint's config files."""
    te, tr, vae = ckpt.text_encoder_config, ckpt.transformer_config, ckpt.vae_config
    hidden = te["hidden_size"]
    layers = ckpt.text_encoder_out_layers
    return {
        "text_encoder": {
            "hidden_size": hidden,
            "num_hidden_layers": te["num_hidden_layers"],
            "layers_in_graph": max(layers),
            "hidden_layers": list(layers),
            "embed_dim": hidden * len(layers),
        },
        "transformer": {
            key: tr[key]
            for key in (
                "in_channels",
                "num_layers",
                "num_single_layers",
                "num_attention_heads",
                "attention_head_dim",
                "joint_attention_dim",
                "axes_dims_rope",
                "rope_theta",
                "guidance_embeds",
            )
        },
        **vae_sections(vae),
    }


def vae_sections(vae: dict) -> dict:
    """The manifest's `vae` and `latents` sections from the VAE's config.json (AutoencoderKLFlux2,
    FLUX.2's and FLUX.3's)."""
    spatial = 2 ** (len(vae["block_out_channels"]) - 1)
    patch = vae.get("patch_size", [2, 2])
    return {
        "vae": {
            "latent_channels": vae["latent_channels"],
            "patch_size": patch[0],
            "spatial_factor": spatial,
            "batch_norm_eps": vae["batch_norm_eps"],
            "block_out_channels": vae["block_out_channels"],
            # The tile side of tiled decoding and encoding (diffusers' tile_sample_min_size).
            "sample_size": _first(vae.get("sample_size", 1024)),
        },
        "latents": {"channels": vae["latent_channels"] * patch[0] * patch[1], "pixel_multiple": spatial * patch[0]},
    }


def architecture_differences(have: dict, want: dict) -> list:
    """`section.key A vs B` for every ARCHITECTURE number that differs between two manifests (or a
    manifest and `architecture(ckpt)`). Numbers one side lacks are not compared: a bundle exported
    by an older klein-export may miss later fields (`vae.sample_size`)."""
    have, want = json.loads(json.dumps(have)), json.loads(json.dumps(want))  # tuples -> lists
    out = []
    for section in ARCHITECTURE:
        a, b = have.get(section) or {}, want.get(section) or {}
        out += [f"{section}.{key} {a[key]} vs {b[key]}" for key in sorted(set(a) & set(b)) if a[key] != b[key]]
    return out


def check_bundle_of(manifest: dict, bundle, ckpt):
    """BundleError unless the bundle's manifest describes the architecture of checkpoint `ckpt`."""
    differences = architecture_differences(manifest, architecture(ckpt))
    if bool(manifest["model"].get("kv_cache")) != ckpt.is_kv:
        differences.append(f"model.kv_cache {bool(manifest['model'].get('kv_cache'))} vs {ckpt.is_kv}")
    if differences:
        raise BundleError(
            f"{Path(bundle) / MANIFEST} does not describe the checkpoint {ckpt.root} "
            f"(manifest vs checkpoint: {'; '.join(differences)}): a bundle of another model or size"
        )


def check_transformer_source(manifest: dict, bundle, transformer_file) -> None:
    """BundleError unless the bundle's transformer was exported from `transformer_file` (the single
    file of `convert --transformer`; None: the checkpoint's own transformer), by sha256."""
    recorded = manifest["model"].get("transformer_file")
    given = None if transformer_file is None else source_file(Path(transformer_file))
    if (recorded or {}).get("sha256") != (given or {}).get("sha256"):
        exported = f"{recorded.get('file')} (sha256 {recorded.get('sha256')})" if recorded else "the checkpoint's own"
        raise BundleError(
            f"{Path(bundle) / MANIFEST}: its transformer was exported from {exported}, "
            + (f"not from {transformer_file}" if given else "not the checkpoint's own")
            + ": give verify the --transformer FILE the bundle was converted with"
            + (" (or none)" if not recorded else "")
        )


def build_manifest(ckpt, tokenizer_facts: dict, graphs: dict, name: str, variant: str) -> dict:
    """Everything but `files` (see `bundle_files`); `graphs` maps each component to its GraphEntry."""
    sch = ckpt.scheduler_config
    distilled = ckpt.is_distilled
    arch = architecture(ckpt)
    spatial = arch["vae"]["spatial_factor"]
    manifest = {
        "format_version": FORMAT_VERSION,
        "model": {
            "name": name,
            "variant": variant,
            "is_distilled": distilled,
            "default_steps": 4 if distilled else 50,
            "default_guidance": 1.0 if distilled else 4.0,
            "default_width": 128 * spatial,  # Flux2KleinPipeline.default_sample_size * vae_scale_factor
            "default_height": 128 * spatial,
        },
        "tokenizer": tokenizer_facts,
        **arch,
        "references": dict(REFERENCES),
        "scheduler": {
            "class": "FlowMatchEulerDiscreteScheduler",
            "num_train_timesteps": sch.get("num_train_timesteps", 1000),
            "shift": sch.get("shift", 1.0),
            "use_dynamic_shifting": sch.get("use_dynamic_shifting", False),
            "time_shift_type": sch.get("time_shift_type", "exponential"),
            "empirical_mu": dict(EMPIRICAL_MU),
        },
        "graphs": {component: graphs[component].to_json() for component in COMPONENTS},
        "files": {},
        "exporter": _versions(),
        "min_onnxruntime_version": MIN_ONNXRUNTIME_VERSION,
    }
    if ckpt.is_kv:
        # Flux2KleinKVPipeline: the transformer graph has the KV form (contract.transformer_kv_io).
        manifest["model"]["kv_cache"] = True
    return manifest


def bundle_files(bundle_dir: Path, known: dict = None, changed=None) -> dict:
    """The manifest's `files`: size and sha256 of every file but the manifest. Entries of `known`
    are reused for files not in `changed` (None: hash everything)."""
    known = known or {}
    files = {}
    for path in sorted(Path(bundle_dir).iterdir()):
        if path.is_file() and path.name != MANIFEST:
            reuse = changed is not None and path.name not in changed and path.name in known
            files[path.name] = known[path.name] if reuse else file_entry(path)
    return files


def check_files(bundle_dir, manifest: dict):
    """BundleError naming the first file the manifest's `files` lists that is missing, or whose
    size or sha256 is not the listed one (replaced, truncated or modified since the export), and
    the first graph or tokenizer file that `files` does not list."""
    bundle_dir = Path(bundle_dir)
    path, files = bundle_dir / MANIFEST, manifest.get("files")
    again = "copy or export the bundle again"
    if not isinstance(files, dict):
        raise BundleError(f"{path}: no files section (the size and sha256 of each file); {again}")
    tokenizer = manifest.get("tokenizer")
    needed = [graph["file"] for graph in manifest["graphs"].values()]
    needed += [tokenizer["file"]] if isinstance(tokenizer, dict) and isinstance(tokenizer.get("file"), str) else []
    unlisted = [name for name in needed if name not in files]
    if unlisted:
        raise BundleError(f"{path}: files does not list {', '.join(unlisted)}, so it cannot be checked; {again}")
    for name, entry in files.items():
        if Path(name).name != name or not isinstance(entry, dict):
            raise BundleError(f"{path}: files.{name} must be a file name in the bundle with its bytes and sha256")
        file = bundle_dir / name
        if not file.is_file():
            raise BundleError(f"{file}: missing (listed in {MANIFEST}); {again}")
        # The size first: a truncated file is named without hashing the files before it.
        size = file.stat().st_size
        found = file_entry(file) if size == entry.get("bytes") else {"bytes": size, "sha256": "(not hashed)"}
        if found != {"bytes": entry.get("bytes"), "sha256": str(entry.get("sha256")).lower()}:
            raise BundleError(
                f"{file}: {found['bytes']} bytes, sha256 {found['sha256'][:12]}..., not the {entry.get('bytes')} "
                f"bytes, sha256 {str(entry.get('sha256'))[:12]}... {MANIFEST} lists: replaced or modified since "
                f"the export; {again}"
            )


def write_manifest(manifest: dict, bundle_dir: Path):
    (Path(bundle_dir) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")


def read_manifest(bundle_dir) -> dict:
    """The bundle's manifest; BundleError naming the file when it is missing, not JSON or without
    the sections every tool reads."""
    path = Path(bundle_dir) / MANIFEST
    manifest = read_json(path, BundleError, "not a klein bundle")
    missing = [key for key in ("model", "graphs", "latents") if not isinstance(manifest.get(key), dict)]
    if missing:
        raise BundleError(f"{path}: no {', '.join(missing)} section (not a manifest written by klein-export)")
    foreign = "(not a manifest written by klein-export)"
    for name, graph in manifest["graphs"].items():
        if not (isinstance(graph, dict) and isinstance(graph.get("file"), str)):
            raise BundleError(f"{path}: graphs.{name} must be an object with a `file` name {foreign}")
        scheme = graph.get("quantization")
        if scheme is not None and not (isinstance(scheme, dict) and isinstance(scheme.get("bits"), int)):
            raise BundleError(f"{path}: graphs.{name}.quantization must be an object with `bits` {foreign}")
    return manifest


def _first(value):
    """A config number that may be given per axis (`sample_size: [1024, 1024]`): the first, as
    diffusers reads it."""
    return value[0] if isinstance(value, (list, tuple)) else value
