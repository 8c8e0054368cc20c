"""`klein-export convert --lora FILE[:SCALE]`: LoRAs merged into the transformer before export.

For the bundles whose weights the runtime cannot rewrite at load time (static-shape bundles for
CoreML, int8/int4 bundles), the LoRA is merged by diffusers itself: `Flux2LoraLoaderMixin` reads the
file in every format it knows (PEFT/diffusers, BFL/ai-toolkit, kohya, LyCORIS and BFL LoKr),
`set_adapters` gives each its scale, and `fuse_lora` + `unload_lora` leave plain merged weights.
FLUX.3 Image Klein's are read by `Flux3LoraLoaderMixin` (PEFT/diffusers and BFL names only).
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from .errors import LoraError, first_names

# LoRAs merged into one bundle at most: the runtime's bound (`MAX_LORAS`, src/limits.rs).
MAX_LORAS = 16

# The model families (manifest `model.family`), each with its diffusers loader.
FLUX2, FLUX3 = "flux2", "flux3"
# What diffusers' FLUX.3 loader reads (`_convert_non_diffusers_flux3_lora_to_diffusers`), as the
# runtime says it (src/stages/lora/keys/flux3.rs).
FLUX3_LOADER = (
    "diffusers' FLUX.3 loader (Flux3LoraLoaderMixin) converts diffusers/PEFT and BFL LoRAs only, and so does "
    "klein for FLUX.3"
)


def _family(family):
    """(the pipeline class whose `lora_state_dict` reads the family's LoRAs, its transformer class, the
    model's name in messages)."""
    if family == FLUX3:
        from diffusers import Flux3Transformer2DModel
        from diffusers.modular_pipelines import Flux3ModularPipeline

        return Flux3ModularPipeline, Flux3Transformer2DModel, "FLUX.3 Image Klein"
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

    return Flux2KleinPipeline, Flux2Transformer2DModel, "FLUX.2"


@dataclass(frozen=True)
class LoraSpec:
    path: Path
    scale: float = 1.0

    def to_json(self) -> dict:
        digest = hashlib.sha256(self.path.read_bytes()).hexdigest()
        return {"file": self.path.name, "sha256": digest, "scale": self.scale}


def _scale(text: str) -> float:
    """A scale as the runtime's `--lora` reads it (Rust's float syntax): Python's extras, digit
    separators (`1_0`, read as 10) and surrounding spaces, are not numbers there."""
    if "_" in text or text != text.strip():
        raise ValueError(text)
    return float(text)


def parse_lora(text: str) -> LoraSpec:
    """`FILE` or `FILE:SCALE` (the scale may be negative or above 1)."""
    path, scale = text, 1.0
    head, sep, tail = text.rpartition(":")
    if sep and head:
        try:
            scale = _scale(tail)
            path = head
        except ValueError:
            if not Path(text).is_file() and Path(head).is_file():
                raise LoraError(
                    f"{text}: the LoRA scale `{tail}` is not a number (give FILE:SCALE, e.g. x:0.8)"
                ) from None
            path = text
    path = Path(path)
    if not path.is_file():
        raise LoraError(f"{path}: no such LoRA file (give FILE or FILE:SCALE, e.g. style.safetensors:0.8)")
    if scale != scale or abs(scale) > 100:
        raise LoraError(f"{text}: the LoRA scale must be a number between -100 and 100")
    return LoraSpec(path, scale)


def check_loras(transformer_config: dict, loras, family=FLUX2):
    """LoraError unless every LoRA of `loras` names layers of the transformer of `transformer_config`
    (its config.json; a model of `family`) with their shapes: before an export, on a weightless (meta)
    copy of the model, so that a LoRA for another model or size is refused in seconds, not after the
    text encoder."""
    if not loras:
        return
    if len(loras) > MAX_LORAS:
        raise LoraError(f"{len(loras)} LoRAs: at most {MAX_LORAS} are merged at once (as the runtime applies)")
    import torch

    pipeline, transformer_class, model = _family(family)
    with torch.device("meta"):
        transformer = transformer_class.from_config(transformer_config)
    for lora in loras:
        _check_file(lora.path, family)
        try:
            state_dict = pipeline.lora_state_dict(str(lora.path))
        except (ValueError, KeyError, RuntimeError, OSError) as e:  # OSError: not a safetensors file
            raise LoraError(f"{lora.path}: diffusers cannot read it as a {model} LoRA: {e}") from e
        _check_complete(state_dict, lora.path)
        _check_modules(transformer, state_dict, lora.path)
        _check_shapes(transformer, state_dict, lora.path)


def merge_loras(transformer, loras, family=FLUX2):
    """Merges `loras` (LoraSpec list) into `transformer` (a Flux2Transformer2DModel, or for `family`
    FLUX3 a Flux3Transformer2DModel) in place."""
    if not loras:
        return transformer
    import torch

    pipeline, _, _ = _family(family)
    names = []
    for i, lora in enumerate(loras):
        name = f"lora{i}"
        try:
            state_dict, metadata = pipeline.lora_state_dict(str(lora.path), return_lora_metadata=True)
            _check_complete(state_dict, lora.path)
            _check_modules(transformer, state_dict, lora.path)
            _check_shapes(transformer, state_dict, lora.path)
            transformer.load_lora_adapter(state_dict, adapter_name=name, metadata=metadata, prefix="transformer")
        except LoraError:
            raise
        except (ValueError, KeyError, RuntimeError, OSError) as e:
            raise LoraError(f"{lora.path}: diffusers cannot apply it to this transformer: {e}") from e
        names.append(name)
    transformer.set_adapters(names, [lora.scale for lora in loras])
    transformer.fuse_lora(lora_scale=1.0, adapter_names=names)
    transformer.unload_lora()
    # Factors within bounds can still merge past float32 (an alpha of 1e30): refused, as the
    # runtime refuses such a merge, not exported as NaN and infinite weights.
    broken = [name for name, weight in transformer.named_parameters() if not torch.isfinite(weight).all()]
    if broken:
        files = ", ".join(str(lora.path) for lora in loras)
        raise LoraError(
            f"{files}: merged into the transformer, {first_names(broken)} hold non-finite values "
            "(NaN or infinity): lower the LoRA's scale, or check its alpha"
        )
    return transformer


# Key prefixes of text-encoder weights (kohya `lora_te1_`, PEFT `text_encoder.`...): the runtime's
# `TEXT_ENCODER_PREFIXES` (src/stages/lora/keys.rs).
TEXT_ENCODER_PREFIXES = ("text_encoder", "lora_te", "te_", "te1_", "te2_")
# diffusers' `LORA_ADAPTER_METADATA_KEY`: the adapter's config, as JSON, in the file's metadata.
METADATA_KEY = "lora_adapter_metadata"


def _check_file(path, family=FLUX2):
    """What diffusers would read without a word, refused as the runtime refuses it (src/stages/lora):
    a file that is not safetensors (diffusers unpickles a `.pt`, which runs its code), text-encoder
    keys and DoRA magnitudes (diffusers drops them and merges the rest: another adapter), and
    non-finite values (the bundle would make black images); for FLUX.3, kohya and LoKr files, which
    its loader does not convert."""
    import json

    import torch

    try:
        with safe_open(str(path), "pt") as f:
            keys, metadata = list(f.keys()), f.metadata() or {}
            dtypes = {k: f.get_slice(k).get_dtype() for k in keys}
            other = sorted(k for k, dtype in dtypes.items() if dtype not in _FLOATS)
            bad = [k for k, dtype in dtypes.items() if dtype in _FLOATS and not torch.isfinite(f.get_tensor(k)).all()]
    except (SafetensorError, OSError) as e:
        raise LoraError(f"{path}: not a safetensors file ({e}); klein reads LoRAs saved as .safetensors") from None
    if other:
        kinds = sorted({dtypes[k] for k in other})
        raise LoraError(
            f"{path}: {first_names(other)} {'is' if len(other) == 1 else 'are'} {', '.join(kinds)}: LoRA weights "
            "are F32, F16 or BF16 (as the runtime reads them)"
        )
    text = sorted(k for k in keys if k.startswith(TEXT_ENCODER_PREFIXES))
    if text:
        raise LoraError(
            f"{path}: {len(text)} text-encoder keys ({first_names(text)}): klein applies LoRAs to the transformer "
            "only, as diffusers' Flux2 loader does (it ignores these keys); use a LoRA without text-encoder weights"
        )
    try:
        config = json.loads(metadata.get(METADATA_KEY, "{}"))
    except ValueError as e:
        raise LoraError(f"{path}: its `{METADATA_KEY}` metadata is not JSON ({e})") from None
    dora = sorted(k for k in keys if "dora_scale" in k or "lora_magnitude_vector" in k)
    if dora or (isinstance(config, dict) and config.get("transformer.use_dora") is True):
        raise LoraError(
            f"{path}: a DoRA adapter ({first_names(dora) or 'use_dora'}): klein applies LoRA and LoKr only "
            "(diffusers drops the DoRA magnitudes and applies the rest, which is another adapter)"
        )
    if bad:
        verb = "holds" if len(bad) == 1 else "hold"
        raise LoraError(f"{path}: {first_names(bad)} {verb} non-finite values (NaN or infinity)")
    if family == FLUX3:
        for marker, kind in ((".lora_down.weight", "a kohya LoRA"), (".lokr_", "a LoKr adapter")):
            found = sorted(k for k in keys if marker in k)
            if found:
                raise LoraError(f"{path}: {kind} (`{found[0]}`): {FLUX3_LOADER}")
        return
    _check_kohya_keys(path, keys)


def _check_kohya_keys(path, keys):
    """A kohya LoRA's keys that diffusers' converter maps to no layer (it only logs them and merges
    the rest: another adapter than the file's) are refused, as the runtime refuses keys it cannot
    place. The converter (the one `lora_state_dict` calls for these files, diffusers pinned) takes
    out every key it maps; what it leaves is what it would drop."""
    if not any(".lora_down.weight" in k for k in keys):
        return
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux2_lora_to_diffusers
    from safetensors.torch import load_file

    left = load_file(str(path))
    try:
        _convert_kohya_flux2_lora_to_diffusers(left)
    except (KeyError, ValueError, IndexError, AssertionError, RuntimeError) as e:
        raise LoraError(
            f"{path}: diffusers cannot read it as a kohya FLUX.2 LoRA ({type(e).__name__}: {e}): a key of no layer, "
            "or half of a lora_down/lora_up pair"
        ) from None
    if left:
        raise LoraError(
            f"{path}: {len(left)} kohya keys name no layer of a FLUX.2 transformer ({first_names(sorted(left))}), "
            "which diffusers would drop while merging the rest: a LoRA for another model (FLUX.1?)"
        )


# safetensors' names of the types a LoRA's tensors may have: the runtime's (src/stages/lora).
_FLOATS = ("F16", "BF16", "F32")


def _check_complete(state_dict, path):
    """A file with no weights (it would load and change nothing) or with half of a pair (diffusers
    fails deep inside PEFT) is refused, as the runtime refuses it."""
    if not state_dict:
        raise LoraError(f"{path}: the file holds no LoRA weights")
    factors = {}
    for key, tensor in state_dict.items():
        module, factor = _split(key)
        factors.setdefault(module, {})[factor.removesuffix(".weight")] = tensor
    for module, names in sorted(factors.items()):
        if ("lora_A" in names) != ("lora_B" in names):
            raise LoraError(f"{path}: {module} has only one of lora_A and lora_B; the file is incomplete")
        if "lora_A" in names:
            shapes = [tuple(names[n].shape) for n in ("lora_A", "lora_B")]
            # 2-D, or a 1x1 convolution's [r, in, 1, 1], as the runtime reads them.
            if any(len(shape) not in (2, 4) or shape[2:] not in ((), (1, 1)) for shape in shapes):
                raise LoraError(
                    f"{path}: {module}'s lora_A and lora_B are {shapes[0]} and {shapes[1]}: a linear layer's "
                    "factors are 2-D"
                )
            if shapes[0][0] != shapes[1][1]:
                raise LoraError(
                    f"{path}: {module}'s lora_A is {shapes[0]} and lora_B {shapes[1]}: their ranks "
                    f"({shapes[0][0]} and {shapes[1][1]}) differ; the file is not a LoRA of one rank per layer"
                )


def _split(key):
    """`transformer.<module>.lora_A.weight` -> (module, "lora_A.weight"); the same for `lokr_*`."""
    rest = key.removeprefix("transformer.")
    for marker in (".lora_", ".lokr_"):
        module, sep, factor = rest.partition(marker)
        if sep:
            return module, marker[1:] + factor
    return rest, ""


def _update_shapes(state_dict) -> dict:
    """module -> ([out, in] of the weight update the file gives it, the keys it was read from)."""
    factors = {}
    for key, tensor in state_dict.items():
        module, factor = _split(key)
        if factor and tensor.dim() == 2:
            factors.setdefault(module, {})[factor.removesuffix(".weight")] = tuple(tensor.shape)
    out = {}
    for module, f in factors.items():
        if "lora_A" in f and "lora_B" in f:
            out[module] = [f["lora_B"][0], f["lora_A"][1]]
        elif (w1 := _lokr_factor(f, "lokr_w1")) and (w2 := _lokr_factor(f, "lokr_w2")):
            out[module] = [w1[0] * w2[0], w1[1] * w2[1]]  # kron(w1, w2)
    return out


def _lokr_factor(factors, name):
    """The shape of a LoKr factor given whole (`lokr_w1`) or as a product (`lokr_w1_a @ lokr_w1_b`)."""
    if name in factors:
        return factors[name]
    if f"{name}_a" in factors and f"{name}_b" in factors:
        return factors[f"{name}_a"][0], factors[f"{name}_b"][1]
    return None


def _check_shapes(transformer, state_dict, path):
    """Every update has the shape of the weight it is added to (else diffusers fails with one torch
    "size mismatch" line per parameter, or, for shapes that happen to broadcast, worse)."""
    from torch import nn

    linears = {name: list(m.weight.shape) for name, m in transformer.named_modules() if isinstance(m, nn.Linear)}
    fused = {"to_qkv": ("to_q", "to_k", "to_v"), "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj")}
    mismatched = []
    for module, shape in sorted(_update_shapes(state_dict).items()):
        want = linears.get(module)
        parent, _, leaf = module.rpartition(".")
        if want is None and leaf in fused:
            parts = [linears.get(f"{parent}.{p}") for p in fused[leaf]]
            if all(parts):
                want = [sum(p[0] for p in parts), parts[0][1]]
        if want is not None and want != shape:
            mismatched.append(f"{module} is {want}, the LoRA gives {shape}")
    if mismatched:
        cfg = transformer.config
        more = f" (and {len(mismatched) - 3} more)" if len(mismatched) > 3 else ""
        raise LoraError(
            f"{path}: {len(mismatched)} layers of this transformer do not have the shape the LoRA was made for: "
            f"{'; '.join(mismatched[:3])}{more}: a LoRA for another size of the model (this transformer's hidden "
            f"size is {cfg.num_attention_heads * cfg.attention_head_dim}; FLUX.2-klein 4B has 3072, 9B 4096)"
        )


def _check_modules(transformer, state_dict, path):
    """Every key names a linear layer of `transformer` (diffusers only warns about keys of no module
    and goes on; PEFT fails on a norm's only when the model loads, after the text encoder's export;
    the runtime applies LoRAs to linear layers only)."""
    import torch

    # A layer an earlier LoRA of the same merge made a PEFT layer holds its linear as `base_layer`.
    modules = {
        name
        for name, module in transformer.named_modules()
        if isinstance(getattr(module, "base_layer", module), torch.nn.Linear)
    }
    fused = {"to_qkv": "to_q", "to_added_qkv": "add_q_proj"}  # LoKr on fused QKV: diffusers fuses the model first
    unknown = []
    for key in state_dict:
        if not key.startswith("transformer."):
            unknown.append(key)
            continue
        module = key.removeprefix("transformer.").split(".lora_")[0].split(".lokr_")[0]
        parent, _, leaf = module.rpartition(".")
        if module not in modules and not (leaf in fused and f"{parent}.{fused[leaf]}" in modules):
            unknown.append(key)
    if unknown:
        raise LoraError(
            f"{path}: {len(unknown)} keys match no linear layer of this transformer, e.g. "
            f"{', '.join(sorted(unknown)[:3])} (a LoRA for another model or size?)"
        )
