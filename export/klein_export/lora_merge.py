"""`klein-export convert --lora FILE[:SCALE]`: LoRAs merged into the transformer before export.

For the bundles whose weights the runtime cannot rewrite at load time (static-shape bundles for
CoreML, int8/int4 bundles), the LoRA is merged by diffusers itself: `Flux2LoraLoaderMixin` reads the
file in every format it knows (PEFT/diffusers, BFL/ai-toolkit, kohya, LyCORIS and BFL LoKr),
`set_adapters` gives each its scale, and `fuse_lora` + `unload_lora` leave plain merged weights.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .errors import LoraError


@dataclass(frozen=True)
class LoraSpec:
    path: Path
    scale: float = 1.0

    def to_json(self) -> dict:
        digest = hashlib.sha256(self.path.read_bytes()).hexdigest()
        return {"file": self.path.name, "sha256": digest, "scale": self.scale}


def parse_lora(text: str) -> LoraSpec:
    """`FILE` or `FILE:SCALE` (the scale may be negative or above 1)."""
    path, scale = text, 1.0
    head, sep, tail = text.rpartition(":")
    if sep and head:
        try:
            scale = float(tail)
            path = head
        except ValueError:
            path = text
    path = Path(path)
    if not path.is_file():
        raise LoraError(f"{path}: no such LoRA file (give FILE or FILE:SCALE, e.g. style.safetensors:0.8)")
    if scale != scale or abs(scale) > 100:
        raise LoraError(f"{text}: the LoRA scale must be a number between -100 and 100")
    return LoraSpec(path, scale)


def merge_loras(transformer, loras):
    """Merges `loras` (LoraSpec list) into `transformer` (a Flux2Transformer2DModel) in place."""
    if not loras:
        return transformer
    from diffusers import Flux2KleinPipeline

    names = []
    for i, lora in enumerate(loras):
        name = f"lora{i}"
        try:
            state_dict, metadata = Flux2KleinPipeline.lora_state_dict(str(lora.path), return_lora_metadata=True)
            _check_modules(transformer, state_dict, lora.path)
            transformer.load_lora_adapter(state_dict, adapter_name=name, metadata=metadata, prefix="transformer")
        except (ValueError, KeyError, RuntimeError) as e:
            raise LoraError(f"{lora.path}: diffusers cannot apply it to this transformer: {e}") from e
        names.append(name)
    transformer.set_adapters(names, [lora.scale for lora in loras])
    transformer.fuse_lora(lora_scale=1.0, adapter_names=names)
    transformer.unload_lora()
    return transformer


def _check_modules(transformer, state_dict, path):
    """Every key names a module of `transformer` (diffusers only warns about the others and goes on)."""
    modules = {name for name, _ in transformer.named_modules()}
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
            f"{path}: {len(unknown)} keys match no layer of this transformer, e.g. {', '.join(sorted(unknown)[:3])} "
            "(a LoRA for another model or size?)"
        )
