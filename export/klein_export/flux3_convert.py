"""`klein-export convert` of a FLUX.3 Image Klein checkpoint (flux3.py) into a klein bundle.

The bundle has FLUX.2's four graphs and manifest schema, with `model.family: "flux3"`; the runtime
follows the family. What differs, all from diffusers' FLUX.3 blocks:
- the text encoder graph is Qwen3-VL's language model with stacked hidden states (flux3_wrappers);
- the tokenizer section pads the window to a multiple of 80 tokens (`pad_multiple`), up to 8192;
- the transformer graph takes the reference tokens apart (`cond_latents`, `cond_ids`) and, for the
  step-distilled checkpoints, `target_timestep` (contract.flux3_transformer_io);
- the scheduler has the constant shift 6.93 and no dynamic shifting;
- 16 steps without guidance (distilled) or 50 with guidance 3.5 (base), 1024x1024 by default.

The FLUX.2 graph rewrites apply: the text encoder's fused norms and attention (ort_fusions.fuse_for_ort),
the transformer's fused attention and rotary embeddings, its fused RMSNorms and its per-image
projections with the weight first (ort_fusions.fuse_transformer); `--precision fp16` with the
modulation kept in float32 (precision.KEEP_FLOAT32["flux3_transformer"]); `--quantize`, once every
graph is exported (quantize.py); the export cache; the transformer's LoRA map (`lora_targets`), so
that the runtime merges FLUX.3 LoRAs at load time; `--lora`, merged at export by diffusers' FLUX.3
loader (lora_merge.py). Not yet for FLUX.3: static shapes and `--transformer`, each refused by name.
"""

import shutil
import time
from pathlib import Path

import torch
from torch.export import Dim

from . import FORMAT_VERSION, contract
from .atomic import atomic_directory, check_output
from .cache_key import stamp_bundle
from .contract import GraphEntry
from .convert import _export_vae, _peak_rss_mb, _scheme_json, _to_precision, export_components
from .errors import BundleExistsError, CheckpointError
from .flux3 import (
    BASE_GUIDANCE,
    BASE_STEPS,
    DEFAULT_SIDE,
    DISTILLED_STEPS,
    FAMILY,
    IMAGE_ROPE_SCALE,
    MAX_SEQUENCE_LENGTH,
    PAD_MULTIPLE,
    SHIFT,
    Flux3Checkpoint,
)
from .flux3_wrappers import Flux3TextEncoder, Flux3Transformer
from .fused_attention import TRANSLATIONS as ATTENTION
from .fused_attention import fused_attention
from .fused_rotary import TRANSLATIONS as ROTARY
from .fused_rotary import fused_rotary
from .lora_map import lora_targets
from .lora_merge import FLUX3 as FLUX3_FAMILY
from .lora_merge import check_loras, merge_loras
from .manifest import (
    EMPIRICAL_MU,
    MIN_ONNXRUNTIME_VERSION,
    REFERENCES,
    _versions,
    bundle_files,
    vae_sections,
    write_manifest,
)
from .onnx_export import export_graph, timestep_frequencies_as_torch
from .ort_fusions import fuse_for_ort, fuse_transformer
from .preview import fit_preview
from .quantize import quantize_bundle
from .tokenizer_facts import split_template


def _export_text_encoder(ckpt, out, precision, loras=()):
    layers = ckpt.text_encoder_out_layers
    depth = ckpt.text_encoder_config["num_hidden_layers"]
    vl = ckpt.load_text_encoder(num_layers=max(layers))
    module = Flux3TextEncoder(vl, layers, depth).eval()
    scheme = _scheme_json(_to_precision(module, "text_encoder", precision))
    hidden = ckpt.text_encoder_config["hidden_size"]
    io = contract.text_encoder_io(hidden * len(layers))
    ids = torch.randint(0, ckpt.text_encoder_config["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.int64)
    mask[1, 7:] = 0
    batch, seq = Dim("batch"), Dim("seq")
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    _, fusions = export_graph(module, (ids, mask), shapes, io, out, precision, fuse=fuse_for_ort)
    return [GraphEntry(io, precision, scheme, fusions=fusions or None)]


def _export_transformer(ckpt, out, precision, loras=()):
    model = merge_loras(ckpt.load_transformer(), loras, FLUX3_FAMILY)
    cfg = model.config
    module = Flux3Transformer(model, IMAGE_ROPE_SCALE).eval()
    scheme = _scheme_json(_to_precision(module, "flux3_transformer", precision), half_attention=True)
    n_axes = len(cfg.axes_dims_rope)
    g = torch.Generator().manual_seed(0)
    tokens, seq, refs = 20, 10, 6  # none of size 0 or 1 (specialised); 0 references work at run time
    args = (
        torch.randn(2, tokens, cfg.in_channels, generator=g),
        torch.randn(2, seq, cfg.joint_attention_dim, generator=g),
        torch.tensor([0.9, 0.9]),
        torch.randint(0, 8, (tokens, n_axes), generator=g),
        torch.randint(0, 8, (seq, n_axes), generator=g),
        torch.randn(2, refs, cfg.cond_in_channels, generator=g),
        torch.randint(-2, 8, (refs, n_axes), generator=g),
    )
    b, t, s, r = Dim("batch"), Dim("tokens"), Dim("seq"), Dim(contract.REF_TOKENS, min=0)
    shapes = {
        "latents": {0: b, 1: t},
        "prompt_embeds": {0: b, 1: s},
        "timestep": {0: b},
        "img_ids": {0: t},
        "txt_ids": {0: s},
        "cond_latents": {0: b, 1: r},
        "cond_ids": {0: r},
    }
    if cfg.flow_map:
        args += (torch.tensor([0.7, 0.7]),)
        shapes["target_timestep"] = {0: b}
    io = contract.flux3_transformer_io(cfg.in_channels, cfg.joint_attention_dim, n_axes, cfg.flow_map)
    channels = cfg.timestep_channels

    def rewrite(program):
        fusions = fuse_transformer(program)
        timestep_frequencies_as_torch(program, channels)
        return {**fusions, **reshapes_allow_zero(program)}

    with fused_attention(half=precision == "fp16", family=FAMILY), fused_rotary(family=FAMILY):
        translations = {**ATTENTION, **ROTARY}
        path, fusions = export_graph(module, args, shapes, io, out, precision, translations, rewrite)
    return [GraphEntry(io, precision, scheme, lora_targets(model, path), fusions or None)]


def reshapes_allow_zero(model) -> dict:
    """Sets `allowzero` on every Reshape of the exported transformer, so that a computed shape with a
    0 (no reference tokens) means 0, not "copy the input's dimension" (ONNX's default, which fails or
    reshapes wrongly there). Refused if a constant shape holds a 0 that meant "copy"."""
    import onnx_ir as ir

    count = 0
    for node in model.graph.all_nodes():
        if node.op_type != "Reshape":
            continue
        shape = node.inputs[1].const_value
        if shape is not None and 0 in shape.numpy():
            raise RuntimeError(f"{node.name}: a constant Reshape shape with 0 ({shape.numpy()}) cannot take allowzero")
        node.attributes["allowzero"] = ir.AttrInt64("allowzero", 1)
        count += 1
    return {"reshape_allowzero": count}


def _export_vae_graphs(ckpt, out, precision, loras=()):
    return _export_vae(ckpt, out, precision, (), fused=True)


EXPORTS = {"text_encoder": _export_text_encoder, "transformer": _export_transformer, "vae": _export_vae_graphs}


def tokenizer_facts(processor) -> dict:
    """The chat template as prefix + prompt + suffix, rendered as `Flux3TextEncoderStep` renders it
    (the processor's `apply_chat_template`, one user message, the generation prompt), and the window:
    right-padded to a multiple of 80 tokens, at most 8192."""

    def render(content):
        return processor.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )

    prefix, suffix = split_template(render)
    tokenizer = processor.tokenizer
    if tokenizer.pad_token_id is None:
        raise CheckpointError("the tokenizer has no pad token")
    return {
        "file": "tokenizer.json",
        "prompt_prefix": prefix,
        "prompt_suffix": suffix,
        "pad_token": tokenizer.pad_token,
        "pad_token_id": int(tokenizer.pad_token_id),
        "padding_side": "right",
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
        "pad_multiple": PAD_MULTIPLE,
        "add_special_tokens": False,
    }


def build_manifest(ckpt, facts, graphs, name, variant) -> dict:
    te, tr, vae = ckpt.text_encoder_config, ckpt.transformer_config, ckpt.vae_config
    layers = ckpt.text_encoder_out_layers
    distilled = ckpt.is_distilled
    transformer = {
        key: tr.get(key, default)
        for key, default in (
            ("in_channels", 128),
            ("cond_in_channels", 128),
            ("num_layers", 5),
            ("num_single_layers", 28),
            ("num_attention_heads", 24),
            ("attention_head_dim", 128),
            ("joint_attention_dim", 20480),
            ("axes_dims_rope", [32, 32, 32, 32]),
            ("rope_theta", 10000),
        )
    }
    transformer.update(guidance_embeds=False, flow_map=distilled, image_rope_scale=IMAGE_ROPE_SCALE)
    return {
        "format_version": FORMAT_VERSION,
        "model": {
            "name": name,
            "variant": variant,
            "family": FAMILY,
            "is_distilled": distilled,
            "default_steps": DISTILLED_STEPS if distilled else BASE_STEPS,
            "default_guidance": 1.0 if distilled else BASE_GUIDANCE,
            "default_width": DEFAULT_SIDE,
            "default_height": DEFAULT_SIDE,
        },
        "tokenizer": facts,
        "text_encoder": {
            "hidden_size": te["hidden_size"],
            "num_hidden_layers": te["num_hidden_layers"],
            "layers_in_graph": max(layers),
            "hidden_layers": list(layers),
            "embed_dim": te["hidden_size"] * len(layers),
        },
        "transformer": transformer,
        **vae_sections(vae),
        # Several references (each fitted under 1 MP and centre-cropped to the 16-pixel grid, as
        # FLUX.2's): diffusers' FLUX.3 processor checks no side or aspect ratio; 16 px a side is
        # what crops to one token. A single reference is kept whole on its canvas (the runtime's
        # fill_reference, bounded in limits.rs).
        "references": dict(REFERENCES, min_side=16, max_aspect_ratio=1024),
        "scheduler": {
            "class": "FlowMatchEulerDiscreteScheduler",
            "num_train_timesteps": 1000,
            "shift": SHIFT,
            "use_dynamic_shifting": False,
            "time_shift_type": "exponential",
            "empirical_mu": dict(EMPIRICAL_MU),
        },
        "graphs": {component: graphs[component].to_json() for component in contract.COMPONENTS},
        "files": {},
        "exporter": _versions(),
        "min_onnxruntime_version": MIN_ONNXRUNTIME_VERSION,
    }


def _refuse(what, given):
    if given:
        raise CheckpointError(
            f"{what} is not available for FLUX.3 Image Klein checkpoints yet: convert without it "
            "(klein exports FLUX.3 with dynamic shapes, in fp32 or fp16, quantized or not)"
        )


def convert_flux3(
    checkpoint,
    out,
    force,
    name,
    variant,
    log,
    precision,
    quantization,
    *,
    static_shapes=None,
    refs=0,
    loras=(),
    transformer=None,
    cache=None,
):
    """Export every component of the FLUX.3 checkpoint `checkpoint` into the bundle directory `out`."""
    _refuse("--static-shapes", static_shapes is not None or refs)
    _refuse("--transformer", transformer is not None)
    ckpt = Flux3Checkpoint(checkpoint)
    check_loras(ckpt.transformer_config, loras, FLUX3_FAMILY)
    ckpt.check_weights()
    out = Path(out)
    inputs = [(ckpt.root, "the checkpoint")] + [(lora.path, "the LoRA") for lora in loras]
    check_output(out, force, inputs, error=BundleExistsError)
    with atomic_directory(out) as tmp:
        facts = tokenizer_facts(ckpt.load_processor())
        shutil.copyfile(ckpt.root / "tokenizer" / "tokenizer.json", tmp / "tokenizer.json")
        graphs = export_components(EXPORTS, ckpt, tmp, precision, loras, True, cache, log)
        kind = "step-distilled" if ckpt.is_distilled else "base"
        steps = DISTILLED_STEPS if ckpt.is_distilled else BASE_STEPS
        log(f"a FLUX.3 Image Klein {kind} model ({ckpt.root}): {steps} steps by default")
        manifest = build_manifest(ckpt, facts, graphs, name or out.name, variant)
        if loras:
            manifest["model"]["loras"] = [lora.to_json() for lora in loras]
        log("fitting the step-preview map on the VAE...")
        manifest["preview"] = fit_preview(ckpt.load_vae())
        log("hashing the bundle's files for the manifest...")
        stamp_bundle(tmp)
        manifest["files"] = bundle_files(tmp)
        write_manifest(manifest, tmp)
        if quantization is not None:  # after every torch module is freed; one graph in memory at a time
            start = time.perf_counter()
            quantize_bundle(tmp, quantization, log=log)
            log(f"quantized in {time.perf_counter() - start:.1f} s (peak RSS {_peak_rss_mb():.0f} MB)")
    return out
