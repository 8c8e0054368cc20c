"""`klein-export convert`: a diffusers FLUX.2-klein checkpoint -> a klein bundle directory.

Components are exported one at a time and freed before the next one is loaded. The bundle is
written to a sibling temporary directory and renamed into place only when complete, so a failed
export leaves nothing half-written behind.
"""

import multiprocessing
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import resource_tracker
from pathlib import Path

import torch
from torch.export import Dim

from . import contract, export_cache
from .atomic import atomic_directory, check_output
from .cache_key import stamp_bundle
from .checkpoint import Checkpoint
from .contract import GraphEntry
from .errors import BundleExistsError, CheckpointError, StaticShapesError
from .flux3 import FAMILY as FLUX3
from .flux3 import Flux3Checkpoint, is_flux3
from .fused_attention import TRANSLATIONS as ATTENTION
from .fused_attention import fused_attention
from .fused_rotary import TRANSLATIONS as ROTARY
from .fused_rotary import fused_rotary
from .kv_cache import KvTransformer, kv_layers
from .lora_map import lora_targets
from .lora_merge import check_loras, merge_loras
from .manifest import build_manifest, bundle_files, source_file, write_manifest
from .onnx_export import export_graph, timestep_frequencies_as_torch
from .ort_fusions import fuse_for_ort, fuse_transformer, fuse_vae
from .precision import check_precision, to_float16
from .preview import fit_preview
from .quantize import QuantizationConfig, quantize_bundle
from .signals import stops_ignored
from .static_shapes import check_refs, make_static, parse_buckets
from .tokenizer_facts import tokenizer_facts
from .wrappers import TextEncoder, Transformer, VaeDecoder, VaeEncoder


def _export_component(label, checkpoint, out, precision, loras, fused):
    """Runs in a child process: exports one component of `checkpoint` (Checkpoint's arguments), returns
    its GraphEntry list and the child's peak RSS."""
    options = {"fused": fused}
    if checkpoint[0] == FLUX3:
        from .flux3_convert import EXPORTS as FLUX3_EXPORTS

        return FLUX3_EXPORTS[label](Flux3Checkpoint(checkpoint[1]), Path(out), precision, loras), _peak_rss_mb()
    return EXPORTS[label](Checkpoint(*checkpoint), Path(out), precision, loras, **options), _peak_rss_mb()


def _export_isolated(label, checkpoint, out, precision, loras, fused=True):
    """Exports one component in a fresh process, so that its memory is really given back before the
    next one loads (in one process the 4B's text encoder and transformer peaks added up past 22 GB,
    glibc and torch keeping freed weights; each alone peaks at 19-20 GB)."""
    context = multiprocessing.get_context("spawn")
    # An interrupted worker leaves its queue's semaphore to multiprocessing's resource tracker, which
    # removes it and says so ("There appear to be 1 leaked semaphore objects"): it starts with the
    # interpreter's -W options, so this one keeps it quiet.
    if RESOURCE_TRACKER_QUIET not in sys.warnoptions:
        sys.warnoptions.append(RESOURCE_TRACKER_QUIET)
    # Ctrl-C, SIGTERM and SIGHUP are the parent's alone (signals.py): the worker starts with them
    # ignored, so that it prints no traceback of its own when its whole group is signalled, and is
    # killed below. So does multiprocessing's resource tracker (started by the pool's queues), which
    # ignores SIGINT and SIGTERM itself but died of a SIGHUP, relaunched with warnings and tracebacks.
    with stops_ignored():
        resource_tracker.ensure_running()
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        with stops_ignored():
            future = pool.submit(_export_component, label, checkpoint, str(out), precision, loras, fused)
        try:
            return future.result()
        except BaseException:
            # Interrupted (or failed): the worker is ended, not waited for; the pool's shutdown then
            # returns at once (it hung at exit when the worker outlived an interrupt).
            for child in multiprocessing.active_children():
                child.kill()
            raise


RESOURCE_TRACKER_QUIET = "ignore::UserWarning:multiprocessing.resource_tracker"


def export_components(labels, ckpt, out, precision, loras, fused, cache, log) -> dict:
    """Exports each of `labels` of the checkpoint `ckpt` (FLUX.2's Checkpoint or Flux3Checkpoint)
    into `out`, each in its own process or from the export `cache`, saying what it did; returns
    {component: GraphEntry}."""
    graphs = {}
    for number, label in enumerate(labels, 1):
        log(f"[{number}/{len(labels)}] exporting {label} ({precision})...")
        start = time.perf_counter()
        if cache is None:
            entries, child_peak_mb = _export_isolated(label, ckpt.arguments, out, precision, tuple(loras), fused)
        else:
            entries, child_peak_mb = _export_cached(Path(cache), ckpt, label, out, precision, loras, fused, log)
        graphs.update((entry.io.component, entry) for entry in entries)
        seconds = time.perf_counter() - start
        if child_peak_mb is None:
            log(f"took {label} ({precision}) from the export cache {cache} in {seconds:.1f} s")
        else:
            log(f"exported {label} ({precision}) in {seconds:.1f} s (peak RSS {child_peak_mb:.0f} MB)")
    return graphs


def _export_cached(cache, ckpt, label, out, precision, loras, fused, log):
    """`_export_isolated` through the export cache: its entry when it has one (peak None), else the
    export, then kept there."""
    log(f"hashing what the {label} export reads, for the export cache...")
    key = export_cache.component_key(ckpt, label, precision, loras, fused)
    with export_cache.locked(cache, key):
        entries = export_cache.fetch(cache, key, out)
        if entries is not None:
            return entries, None
        before = {p.name for p in out.iterdir()}
        entries, peak = _export_isolated(label, ckpt.arguments, out, precision, tuple(loras), fused)
        export_cache.store(cache, key, out, sorted({p.name for p in out.iterdir()} - before), entries)
        return entries, peak


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _to_precision(module, component, precision):
    """Applies `precision` to `module` in place; the PrecisionScheme (None for fp32)."""
    return to_float16(module, component) if precision == "fp16" else None


def _scheme_json(scheme, prefixes=("",), half_attention=False):
    """The manifest's `precision_scheme` of the graph holding the modules under `prefixes`;
    `half_attention`: the graph's attention runs in float16 (fused_attention's `half`)."""
    return None if scheme is None else scheme.subset(prefixes).to_json(half_attention)


def _export_text_encoder(ckpt, out, precision, loras, fused=True):
    """`fused`: norms and attention as ONNX Runtime's fused operators (ort_fusions.fuse_for_ort);
    off for CoreML's static-shape bundles, as the transformer's."""
    layers = ckpt.text_encoder_out_layers
    lm = ckpt.load_text_encoder(num_layers=max(layers))
    module = TextEncoder(lm, layers).eval()
    scheme = _scheme_json(_to_precision(module, "text_encoder", precision))
    io = contract.text_encoder_io(lm.config.hidden_size * len(layers))
    # Example batch 2 (a size-1 example dimension is specialised to 1), one row padded.
    ids = torch.randint(0, lm.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 12, dtype=torch.int64)
    mask[1, 7:] = 0
    batch, seq = Dim("batch"), Dim("seq")
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    _, fusions = export_graph(module, (ids, mask), shapes, io, out, precision, fuse=fuse_for_ort if fused else None)
    return [GraphEntry(io, precision, scheme, fusions=fusions or None)]


def _export_transformer(ckpt, out, precision, loras, fused=True):
    """`fused`: attention as one MultiHeadAttention node (fused_attention.py), rotary embeddings as
    RotaryEmbedding (fused_rotary.py), RMSNorms as SimplifiedLayerNormalization and the per-image
    projections with the weight first (ort_fusions.fuse_transformer); off for CoreML's static-shape
    bundles, whose provider does not run ONNX Runtime's own operators. A KV checkpoint's transformer
    is exported in its KV form (kv_cache.py), always fused."""
    model = merge_loras(ckpt.load_transformer(), loras)
    cfg = model.config
    module = (KvTransformer(model) if ckpt.is_kv else Transformer(model)).eval()
    scheme = _scheme_json(_to_precision(module, "transformer", precision), half_attention=fused)
    n_axes = len(cfg.axes_dims_rope)
    g = torch.Generator().manual_seed(0)
    tokens, seq = 20, 10
    args = (
        torch.randn(2, tokens, cfg.in_channels, generator=g),
        torch.randn(2, seq, cfg.joint_attention_dim, generator=g),
        torch.tensor([0.9, 0.9]),
        torch.randint(0, 8, (tokens, n_axes), generator=g),
        torch.randint(0, 8, (seq, n_axes), generator=g),
    )
    b, t, s = Dim("batch"), Dim("tokens"), Dim("seq")
    shapes = {
        "latents": {0: b, 1: t},
        "prompt_embeds": {0: b, 1: s},
        "timestep": {0: b},
        "img_ids": {0: t},
        "txt_ids": {0: s},
    }
    if ckpt.is_kv:
        layers, inner = kv_layers(cfg), cfg.num_attention_heads * cfg.attention_head_dim
        io = contract.transformer_kv_io(cfg.in_channels, cfg.joint_attention_dim, n_axes, layers, inner)
        # Both lengths non-zero in the example (a size 0 or 1 would be specialised); 0 works at run time.
        refs, cached = 6, 5
        args += (
            torch.randn(2, refs, cfg.in_channels, generator=g),
            torch.randint(0, 8, (refs, n_axes), generator=g),
            torch.randn(layers, 2, 2, cached, inner, generator=g),
        )
        r, k = Dim(contract.REF_TOKENS, min=0), Dim(contract.CACHED_TOKENS, min=0)
        shapes.update({"ref_latents": {0: b, 1: r}, "ref_ids": {0: r}, "cached_kv": {2: b, 3: k}})
    else:
        io = contract.transformer_io(cfg.in_channels, cfg.joint_attention_dim, n_axes)
    channels = cfg.timestep_guidance_channels

    def rewrite(model):
        fusions = fuse_transformer(model) if fused else {}
        timestep_frequencies_as_torch(model, channels)
        return fusions

    if fused:
        with fused_attention(half=precision == "fp16"), fused_rotary():
            translations = {**ATTENTION, **ROTARY}
            path, fusions = export_graph(module, args, shapes, io, out, precision, translations, rewrite)
    else:
        path, fusions = export_graph(module, args, shapes, io, out, precision, fuse=rewrite)
    return [GraphEntry(io, precision, scheme, lora_targets(model, path), fusions or None)]


def _export_vae(ckpt, out, precision, loras, fused=True):
    """`fused`: group norms as LayerNormalization and the decoder's upsamplers as phase convolutions
    (ort_fusions.fuse_vae); off for CoreML's static-shape bundles, as the other graphs' rewrites."""
    vae = ckpt.load_vae()
    fuse = fuse_vae if fused else None
    scheme = _to_precision(vae, "vae", precision)  # one module behind both graphs
    enc_scheme = _scheme_json(scheme, ("encoder.", "quant_conv"))
    dec_scheme = _scheme_json(scheme, ("decoder.", "post_quant_conv"))
    latent_ch = vae.config.latent_channels * 4
    lat_h, lat_w = Dim("lat_h", min=1, max=1024), Dim("lat_w", min=1, max=1024)
    enc_io = contract.vae_encoder_io(latent_ch)
    image = torch.rand(2, 3, 48, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    _, enc_fusions = export_graph(
        VaeEncoder(vae).eval(),
        (image,),
        {"image": {0: Dim("batch"), 2: 16 * lat_h, 3: 16 * lat_w}},
        enc_io,
        out,
        precision,
        fuse=fuse,
    )
    dec_io = contract.vae_decoder_io(latent_ch)
    latents = torch.randn(2, latent_ch, 3, 4, generator=torch.Generator().manual_seed(0))
    _, dec_fusions = export_graph(
        VaeDecoder(vae).eval(),
        (latents,),
        {"latents": {0: Dim("batch"), 2: lat_h, 3: lat_w}},
        dec_io,
        out,
        precision,
        fuse=fuse,
    )
    return [
        GraphEntry(enc_io, precision, enc_scheme, fusions=enc_fusions or None),
        GraphEntry(dec_io, precision, dec_scheme, fusions=dec_fusions or None),
    ]


# The published widths of the named variants: text encoder hidden size, transformer hidden size
# (heads x head dim), joint_attention_dim. Their LoRAs and prompt embeddings fit no other.
VARIANT_WIDTHS = {"4b": (2560, 3072, 7680), "9b": (4096, 4096, 12288)}


def check_variant(ckpt, variant):
    """CheckpointError if `variant` is 4b or 9b and the checkpoint does not have its widths (the
    manifest would name one model and hold another; depths are not checked: "wide" checkpoints
    keep the widths with fewer layers)."""
    if variant not in VARIANT_WIDTHS:
        return
    tr = ckpt.transformer_config
    widths = (
        ckpt.text_encoder_config.get("hidden_size"),
        tr.get("num_attention_heads", 0) * tr.get("attention_head_dim", 0),
        tr.get("joint_attention_dim"),
    )
    if widths != VARIANT_WIDTHS[variant]:
        named = [name for name, w in VARIANT_WIDTHS.items() if w == widths]
        what = f"the widths of klein {named[0]}" if named else "the widths of neither klein 4B nor 9B"

        def describe(w):
            return f"text encoder {w[0]}, transformer {w[1]}, joint_attention_dim {w[2]}"

        raise CheckpointError(
            f"--variant {variant}: {ckpt.root} has {what} ({describe(widths)}), klein {variant} has "
            f"{describe(VARIANT_WIDTHS[variant])}; give the checkpoint's variant, or custom"
        )


# The components in export order (one process each), with the function that writes their graphs.
EXPORTS = {"text_encoder": _export_text_encoder, "transformer": _export_transformer, "vae": _export_vae}


def convert(
    checkpoint,
    out,
    force=False,
    name=None,
    variant="custom",
    log=print,
    precision="fp32",
    quantization=None,
    static_shapes=None,
    refs=0,
    loras=(),
    transformer=None,
    cache=None,
):
    """Export every component of `checkpoint` into the bundle directory `out`.

    `precision` is "fp32" or "fp16" (precision.py); `quantization` a QuantizationConfig or None
    (quantize.py): its components are quantized once every graph is exported, one graph at a time.
    `static_shapes` ("1024x1024,768x1024", static_shapes.py) makes fixed-shape graphs for CoreML,
    per size bucket, each taking `refs` references of the output's size. `loras` (lora_merge.LoraSpec
    list) are merged into the transformer before export, and listed in the manifest's `model.loras`.
    `transformer`: a single .safetensors file with the transformer's weights (single_file.py), used
    instead of the checkpoint's, recorded as the manifest's `model.transformer_file`.
    `cache`: a directory of exported components (export_cache.py), read and written.
    """
    check_precision(precision)
    if quantization is not None and not isinstance(quantization, QuantizationConfig):
        raise TypeError("quantization must be a QuantizationConfig or None")
    if is_flux3(checkpoint):
        from .flux3_convert import convert_flux3

        options = dict(static_shapes=static_shapes, refs=refs, loras=loras, transformer=transformer, cache=cache)
        return convert_flux3(checkpoint, out, force, name, variant, log, precision, quantization, **options)
    ckpt = Checkpoint(checkpoint, transformer)
    check_variant(ckpt, variant)
    check_loras(ckpt.transformer_config, loras)
    ckpt.check_weights()
    out = Path(out)
    inputs = [(ckpt.root, "the checkpoint")] + [(lora.path, "the LoRA") for lora in loras]
    inputs += [(ckpt.transformer_file, "the transformer file")] if transformer is not None else []
    check_output(out, force, inputs, error=BundleExistsError)
    buckets = None
    if static_shapes is not None:
        if quantization is not None:
            raise StaticShapesError("--static-shapes is for CoreML, which cannot run MatMulNBits: leave out --quantize")
        if ckpt.is_kv:
            raise StaticShapesError(
                f"--static-shapes: {checkpoint} is a KV checkpoint (Flux2KleinKVPipeline), whose transformer "
                "takes a reference K/V cache of changing length; export it without --static-shapes"
            )
        check_refs(refs)
        vae = ckpt.vae_config
        multiple = 2 ** (len(vae["block_out_channels"]) - 1) * vae.get("patch_size", [2, 2])[0]
        buckets = parse_buckets(static_shapes, multiple)
    elif refs:
        raise StaticShapesError("--refs applies with --static-shapes only")
    with atomic_directory(out) as tmp:
        tokenizer = ckpt.load_tokenizer()
        facts = tokenizer_facts(tokenizer)
        shutil.copyfile(ckpt.root / "tokenizer" / "tokenizer.json", tmp / "tokenizer.json")
        del tokenizer
        graphs = export_components(EXPORTS, ckpt, tmp, precision, loras, buckets is None, cache, log)
        kind = "KV" if ckpt.is_kv else "distilled" if ckpt.is_distilled else "base"
        log(f"a {kind} model (model_index.json of {ckpt.root}): {4 if ckpt.is_distilled else 50} steps by default")
        manifest = build_manifest(ckpt, facts, graphs, name or out.name, variant)
        start = time.perf_counter()
        log("fitting the step-preview map on the VAE...")
        manifest["preview"] = fit_preview(ckpt.load_vae())
        log(f"fitted the step-preview map in {time.perf_counter() - start:.1f} s")
        if loras:
            manifest["model"]["loras"] = [lora.to_json() for lora in loras]
        if transformer is not None:
            manifest["model"]["transformer_file"] = source_file(ckpt.transformer_file)
        if buckets is not None:
            seq = facts["max_sequence_length"]
            manifest["static_shapes"] = make_static(
                tmp, manifest["graphs"], buckets, refs, seq, manifest["latents"]["pixel_multiple"], log
            )
        start = time.perf_counter()
        log("hashing the bundle's files for the manifest...")
        stamp_bundle(tmp)
        manifest["files"] = bundle_files(tmp)
        write_manifest(manifest, tmp)
        log(f"hashed and wrote the manifest in {time.perf_counter() - start:.1f} s")
        if quantization is not None:
            # After every torch module is freed; one graph in memory at a time.
            start = time.perf_counter()
            quantize_bundle(tmp, quantization, log=log)
            log(f"quantized in {time.perf_counter() - start:.1f} s (peak RSS {_peak_rss_mb():.0f} MB)")
    return out
