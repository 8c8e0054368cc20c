"""The values of a checkpoint's config.json files that the export, diffusers and transformers compute
with, checked when the checkpoint is opened: a string or a fraction there fails deep inside torch,
with a traceback, sometimes minutes into the export."""

import json
import math
from pathlib import Path

from .errors import CheckpointError

SIZE = "a positive whole number"
SIZES = "a list of positive whole numbers"
SIZE_OR_SIZES = "a positive whole number or a list of them"
SIZE_OR_NULL = "a positive whole number or null"
NUMBER = "a finite positive number"
BOOLEAN = "true or false"


def _size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _sizes(value) -> bool:
    return isinstance(value, list) and bool(value) and all(map(_size, value))


ACCEPTS = {
    SIZE: _size,
    SIZES: _sizes,
    SIZE_OR_SIZES: lambda v: _size(v) or _sizes(v),
    SIZE_OR_NULL: lambda v: v is None or _size(v),
    NUMBER: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
    BOOLEAN: lambda v: isinstance(v, bool),
}

# What each key may hold, where present (the classes' defaults apply otherwise). `a.b` is key `b`
# of the object `a` (transformers 5 keeps the rotary base in `rope_parameters`, older configs at
# the top).
CONFIG_VALUES = {
    "text_encoder": {
        "hidden_size": SIZE,
        "num_hidden_layers": SIZE,
        "num_attention_heads": SIZE,
        "num_key_value_heads": SIZE,
        "head_dim": SIZE,
        "intermediate_size": SIZE,
        "vocab_size": SIZE,
        "max_position_embeddings": SIZE,
        "rms_norm_eps": NUMBER,
        "rope_theta": NUMBER,
        "rope_parameters.rope_theta": NUMBER,
    },
    "transformer": {
        "attention_head_dim": SIZE,
        "num_attention_heads": SIZE,
        "num_layers": SIZE,
        "num_single_layers": SIZE,
        "joint_attention_dim": SIZE,
        "in_channels": SIZE,
        "out_channels": SIZE_OR_NULL,
        "patch_size": SIZE,
        "timestep_guidance_channels": SIZE,
        "axes_dims_rope": SIZES,
        "mlp_ratio": NUMBER,
        "rope_theta": NUMBER,
        "eps": NUMBER,
        "guidance_embeds": BOOLEAN,
    },
    "vae": {
        "in_channels": SIZE,
        "out_channels": SIZE,
        "latent_channels": SIZE,
        "layers_per_block": SIZE,
        "norm_num_groups": SIZE,
        "block_out_channels": SIZES,
        "patch_size": SIZES,
        "sample_size": SIZE_OR_SIZES,
        "batch_norm_eps": NUMBER,
    },
}


def check_config_values(path: Path, config: dict, values: dict) -> None:
    """CheckpointError naming the file, the key and the value of the first of `values` (key -> what
    it must be) present in `config` with a value of another kind."""
    for key, want in values.items():
        holder, _, name = key.rpartition(".")
        section = config.get(holder) if holder else config
        if holder and section is not None and not isinstance(section, dict):
            raise CheckpointError(f"{path}: {holder} is {json.dumps(section)}; it must be an object ({{...}})")
        if section is None or name not in section:
            continue
        if not ACCEPTS[want](section[name]):
            raise CheckpointError(f"{path}: {key} is {json.dumps(section[name])}; it must be {want}")
