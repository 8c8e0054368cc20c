"""`klein-export convert --transformer FILE`: a fine-tuned transformer shipped as one `.safetensors`
file (as BFL, ComfyUI and most fine-tunes ship it), exported with the rest of a diffusers checkpoint.

The file's keys may be BFL's (`double_blocks.0.img_attn.qkv.weight`), ComfyUI's (the same under
`model.diffusion_model.`) or diffusers' own (taken as they are); diffusers' single-file converter
(`convert_flux2_transformer_checkpoint_to_diffusers`, what `from_single_file` calls) maps the others
to diffusers' names. The model is then built on the meta device and takes the converted tensors, each
cast to float32 while the file's others are freed: loading the full-size 4B from a bfloat16 file
peaked at 16.0 GB (its float32 weights are 15.5 GB).
"""

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .errors import CheckpointError, first_names

# Prefixes of a transformer's keys inside a whole-model file (ComfyUI's, BFL's own); the other
# keys of such a file (the VAE's, the text encoder's) are not the transformer's.
PREFIXES = ("model.diffusion_model.", "diffusion_model.")
# safetensors' names of the types a transformer's weights may have here.
FLOATS = ("F32", "F16", "BF16")


def _open(path: Path):
    if path.is_dir():
        raise CheckpointError(
            f"{path}: a directory; --transformer takes one .safetensors file (a diffusers transformer folder "
            "belongs in a checkpoint given with --checkpoint)"
        )
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file (--transformer takes one .safetensors file)")
    try:
        return safe_open(str(path), "pt")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); --transformer takes one") from None


def _keys(f) -> dict:
    """The file's transformer keys -> their names without the whole-model prefix."""
    keys = list(f.keys())
    prefix = next((p for p in PREFIXES if any(k.startswith(p) for k in keys)), "")
    return {k: k.removeprefix(prefix) for k in keys if k.startswith(prefix)}


# Keys only diffusers' layout has: such a file is taken as it is (diffusers' converter renames by
# substring, and would turn `double_stream_modulation_img.linear` into `...linearear`).
DIFFUSERS_KEYS = ("x_embedder.", "transformer_blocks.", "single_transformer_blocks.")


def _converted(path: Path, state_dict: dict) -> dict:
    """`state_dict` under diffusers' names; CheckpointError when the converter cannot map it."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    if any(k.startswith(DIFFUSERS_KEYS) for k in state_dict):
        return state_dict
    try:
        return convert_flux2_transformer_checkpoint_to_diffusers(state_dict)
    except Exception as e:  # KeyError, IndexError, ValueError...: a key the converter cannot place
        raise CheckpointError(
            f"{path}: not a FLUX.2 transformer in BFL, ComfyUI or diffusers key names (diffusers' converter "
            f"stopped at {e}): --transformer takes a FLUX.2-klein transformer"
        ) from None


# Key parts of LoRA files (PEFT, kohya, LoKr), which --lora takes.
LORA_KEYS = (".lora_A.", ".lora_B.", ".lora_down.", ".lora_up.", ".lokr_", "lora_unet_")


def stored_shapes(path: Path) -> dict:
    """diffusers name -> shape of every weight the file gives the transformer (from its header: no
    data read), for Checkpoint.check_weights; its types checked."""
    with _open(path) as f:
        keys = _keys(f)
        if any(part in k for k in keys for part in LORA_KEYS):
            raise CheckpointError(
                f"{path}: a LoRA (its keys are LoRA factors), not a transformer's weights: give it with --lora"
            )
        dtypes = {k: f.get_slice(k).get_dtype() for k in keys}
        other = sorted(k for k, dtype in dtypes.items() if dtype not in FLOATS)
        if other:
            kinds = ", ".join(sorted({dtypes[k] for k in other}))
            raise CheckpointError(
                f"{path}: {first_names(other)} {'is' if len(other) == 1 else 'are'} {kinds}: --transformer takes "
                "float32, float16 or bfloat16 weights (a float8 or quantized file: use its bf16 release)"
            )
        meta = {name: torch.empty(f.get_slice(k).get_shape(), device="meta") for k, name in keys.items()}
    return {name: list(t.shape) for name, t in _converted(path, meta).items()}


# safetensors' type names -> torch's, for the types a transformer's weights may have here.
TORCH_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _read(path: Path) -> dict:
    """The file's transformer tensors (their names without the whole-model prefix), each read into
    memory of its own with plain file reads: a memory-mapped file's pages, once touched, would stay
    in the process's memory beside the float32 copies (4B: 23.5 GB peak instead of 16.0)."""
    with _open(path) as f:
        names = _keys(f)
    with open(path, "rb") as file:
        size = int.from_bytes(file.read(8), "little")
        header, start = json.loads(file.read(size)), 8 + size
        tensors = {}
        for key, name in names.items():
            entry = header[key]
            tensor = torch.empty(entry["shape"], dtype=TORCH_TYPES[entry["dtype"]])
            file.seek(start + entry["data_offsets"][0])
            if file.readinto(tensor.view(-1).view(torch.uint8).numpy()) != tensor.nbytes:
                raise CheckpointError(f"{path}: {key} is cut short; copy or download the file again")
            tensors[name] = tensor
    return tensors


def load_transformer(path: Path, config: dict):
    """The Flux2Transformer2DModel of `config` (the checkpoint's transformer config) with the file's
    weights, in float32; CheckpointError naming the file when they are not that model's."""
    from diffusers import Flux2Transformer2DModel

    state_dict = _converted(path, _read(path))
    for name in list(state_dict):  # one tensor in two types at a time
        state_dict[name] = state_dict.pop(name).to(torch.float32).contiguous()
    with torch.device("meta"):
        model = Flux2Transformer2DModel.from_config(config)
    try:
        model.load_state_dict(state_dict, strict=True, assign=True)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: its weights are not this checkpoint's transformer's ({e})") from None
    return model.eval()
