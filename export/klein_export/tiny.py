"""A tiny random-weight FLUX.2-klein checkpoint built with the real diffusers/transformers classes.

Same `save_pretrained` layout as the published checkpoints, the real Qwen3 vocabulary and special
tokens, Qwen3 with 28 layers (so hidden layers 9/18/27 exist and one layer is cut by the exporter),
2 double + 2 single transformer blocks, a 4-level VAE with BatchNorm statistics that are not 0/1.

The initialisation makes every stage matter to the final image (see ../shared notes, and the test
`test_tiny_sensitivity`): linear weights at gain/sqrt(fan_in), with larger gains on the modulation
and the text projection, and QK-norm weights of 4, so that a wrong hidden layer, pad token, template,
seed or reference shows in the image.
"""

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .atomic import atomic_directory, check_output
from .checkpoint import DEFAULT_OUT_LAYERS, OUT_LAYERS_KEY
from .errors import OutputExistsError

ASSETS = Path(__file__).parent / "assets" / "qwen3-tokenizer"

# Tiny architecture. The Qwen3 hidden size is small because the embedding table has the real
# vocabulary (151,936 rows) and the bundle must stay small enough to commit.
TINY_QWEN3 = dict(
    vocab_size=151936,
    hidden_size=16,
    intermediate_size=48,
    num_hidden_layers=28,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    max_position_embeddings=1024,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY_TRANSFORMER = dict(
    patch_size=1,
    in_channels=128,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=3 * 16,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(8, 8, 8, 8),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=False,
)
TINY_VAE = dict(
    block_out_channels=(16, 32, 32, 32),
    layers_per_block=1,
    latent_channels=32,
    norm_num_groups=8,
    sample_size=64,
)
SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
    time_shift_type="exponential",
)


def _init_(module: nn.Module, generator: torch.Generator, gains: dict):
    """Initialise every parameter from `generator`: linears and convs at gain/sqrt(fan_in)."""
    for name, sub in module.named_modules():
        gain = next((g for key, g in gains.items() if key in name), 1.0)
        if isinstance(sub, (nn.Linear, nn.Conv2d)):
            fan_in = sub.weight[0].numel()
            with torch.no_grad():
                sub.weight.copy_(torch.randn(sub.weight.shape, generator=generator) * gain / math.sqrt(fan_in))
                if sub.bias is not None:
                    sub.bias.copy_(torch.randn(sub.bias.shape, generator=generator) * 0.1)
        elif isinstance(sub, nn.Embedding):
            with torch.no_grad():
                sub.weight.copy_(torch.randn(sub.weight.shape, generator=generator))
        elif hasattr(sub, "weight") and isinstance(sub.weight, nn.Parameter) and sub.weight.dim() == 1:
            # norms: weights around `gain` (QK norms use a large gain: sharp attention)
            with torch.no_grad():
                sub.weight.copy_(gain * (1.0 + 0.1 * torch.randn(sub.weight.shape, generator=generator)))
                if getattr(sub, "bias", None) is not None and isinstance(sub.bias, nn.Parameter):
                    sub.bias.copy_(0.1 * torch.randn(sub.bias.shape, generator=generator))


# The published FLUX.2-klein-4B architecture (Qwen3-4B text encoder, 5 double + 20 single blocks,
# the default AutoencoderKLFlux2), and "wide": the same widths with fewer blocks, so that one
# generation takes minutes on 2 cores while each block costs what it costs in the real model.
FULL_QWEN3 = dict(
    TINY_QWEN3,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
)
FULL_TRANSFORMER = dict(
    TINY_TRANSFORMER,
    num_layers=5,
    num_single_layers=20,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3 * 2560,
    axes_dims_rope=(32, 32, 32, 32),
)
FULL_VAE = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=32, norm_num_groups=32)

# FLUX.2-klein-9B: Qwen3-8B (hidden 4096, 36 layers, 32/8 heads, an untied lm_head; 8.19 B parameters),
# 8 double + 24 single blocks of 32 heads x 128 (9.08 B parameters), the 4B's VAE.
FULL_QWEN3_9B = dict(FULL_QWEN3, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)
FULL_TRANSFORMER_9B = dict(
    FULL_TRANSFORMER, num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=3 * 4096
)

# "9b-wide": the 9B widths with 1 double + 2 single blocks and a 4-layer Qwen3 whose layers 1, 2, 3
# feed the transformer (recorded as `text_encoder_out_layers` in model_index.json). At 4096 wide one
# Qwen3 layer is 0.19 B parameters: the 27 layers of the published hidden layers 9/18/27 would be
# 5.2 B (21 GB in float32), too large to export or compare with diffusers in float32 here. Layer 4
# exists so that the exporter still cuts the layers after the last one used (and because
# transformers returns the *normed* output as the last layer's hidden state). The lm_head is tied to
# the embeddings (the pipeline never uses it; untied it would add 2.5 GB to every float32 load).
WIDE_9B_OUT_LAYERS = (1, 2, 3)


@dataclass(frozen=True)
class Preset:
    qwen: dict
    transformer: dict
    vae: dict
    storage: str  # the dtype of the saved weights
    out_layers: tuple = None  # text_encoder_out_layers, when not the pipeline's default (9, 18, 27)


PRESETS = {
    "tiny": Preset(TINY_QWEN3, TINY_TRANSFORMER, TINY_VAE, "float32"),
    "wide": Preset(
        dict(FULL_QWEN3, num_hidden_layers=28),
        dict(FULL_TRANSFORMER, num_layers=1, num_single_layers=2),
        FULL_VAE,
        "bfloat16",
    ),
    "4b": Preset(FULL_QWEN3, FULL_TRANSFORMER, FULL_VAE, "bfloat16"),
    "9b-wide": Preset(
        dict(FULL_QWEN3_9B, num_hidden_layers=4, tie_word_embeddings=True),
        dict(FULL_TRANSFORMER_9B, num_layers=1, num_single_layers=2),
        FULL_VAE,
        "bfloat16",
        WIDE_9B_OUT_LAYERS,
    ),
    # The published architecture, 17 B parameters: 34 GB in bfloat16, about 70 GB to build.
    "9b": Preset(FULL_QWEN3_9B, FULL_TRANSFORMER_9B, FULL_VAE, "bfloat16"),
}


def build_tiny(
    out_dir,
    seed: int = 0,
    transformer_overrides=None,
    vae_overrides=None,
    qwen_overrides=None,
    preset="tiny",
    distilled: bool = True,
    out_layers=None,
    kv: bool = False,
):
    """Write a random-weight checkpoint of `preset` to `out_dir` (which must not exist).

    Components are built, saved and freed one at a time (the 4B preset does not fit in memory
    at once); large presets are stored in bfloat16, as the published checkpoints are. `out_layers`
    (default: the preset's) are the text encoder's hidden layers the pipeline concatenates; other
    than (9, 18, 27) they are written to model_index.json as `text_encoder_out_layers`. `kv`: a
    checkpoint of the KV variant (`Flux2KleinKVPipeline`, step-distilled only).
    """
    if kv and not distilled:
        raise ValueError("the KV variant is step-distilled only: a base KV checkpoint does not exist")
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise OutputExistsError(f"{out_dir}: already exists (choose a new directory)")
    check_output(out_dir, force=False)  # under a file
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    spec = PRESETS[preset]
    qwen_cfg, transformer_cfg, vae_cfg, storage = spec.qwen, spec.transformer, spec.vae, spec.storage
    out_layers = spec.out_layers if out_layers is None else tuple(out_layers)
    with atomic_directory(out_dir) as tmp:  # removed if anything fails, renamed when complete
        g = torch.Generator("cpu").manual_seed(seed)
        dtype = getattr(torch, storage)

        def save(model, component):
            if dtype != torch.float32:
                model.to(dtype)
            model.save_pretrained(tmp / component)

        qwen = Qwen3ForCausalLM(Qwen3Config(**{**qwen_cfg, **(qwen_overrides or {})})).eval()
        _init_(qwen, g, {"q_norm": 2.0, "k_norm": 2.0})
        save(qwen, "text_encoder")
        del qwen

        transformer = Flux2Transformer2DModel(**{**transformer_cfg, **(transformer_overrides or {})}).eval()
        _init_(
            transformer,
            g,
            {
                "norm_q": 4.0,
                "norm_k": 4.0,
                "norm_added_q": 4.0,
                "norm_added_k": 4.0,
                "modulation": 2.0,
                "context_embedder": 4.0,
            },
        )
        save(transformer, "transformer")
        del transformer

        vae = AutoencoderKLFlux2(**{**vae_cfg, **(vae_overrides or {})}).eval()
        _init_(vae, g, {})
        with torch.no_grad():
            vae.bn.running_mean.copy_(0.5 * torch.randn(vae.bn.running_mean.shape, generator=g))
            vae.bn.running_var.copy_(0.5 + 1.5 * torch.rand(vae.bn.running_var.shape, generator=g))
        save(vae, "vae")
        del vae

        FlowMatchEulerDiscreteScheduler(**SCHEDULER).save_pretrained(tmp / "scheduler")
        (tmp / "tokenizer").mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(ASSETS / name, tmp / "tokenizer" / name)
        (tmp / "model_index.json").write_text(
            json.dumps(_model_index(distilled, out_layers, kv), indent=2) + "\n", encoding="utf-8"
        )
    return out_dir


def _model_index(distilled: bool, out_layers=None, kv: bool = False) -> dict:
    """What `Flux2KleinPipeline.save_pretrained` writes for a klein checkpoint: distilled (4 steps, no
    guidance) or base (50 steps, classifier-free guidance); plus `text_encoder_out_layers` when the
    checkpoint needs other layers than the pipeline's default (diffusers ignores the key, with a
    warning: pass them to the pipeline's `text_encoder_out_layers=`). A KV checkpoint names
    `Flux2KleinKVPipeline`, whose config has no `is_distilled`."""
    import diffusers

    index = {
        "_class_name": "Flux2KleinKVPipeline" if kv else "Flux2KleinPipeline",
        "_diffusers_version": diffusers.__version__,
        **({} if kv else {"is_distilled": distilled}),
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3ForCausalLM"],
        "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
    }
    if out_layers is not None and tuple(out_layers) != DEFAULT_OUT_LAYERS:
        index[OUT_LAYERS_KEY] = list(out_layers)
    return index
