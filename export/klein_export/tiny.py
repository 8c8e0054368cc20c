"""A tiny random-weight FLUX.2-klein checkpoint built with the real diffusers/transformers classes.

Same `save_pretrained` layout as the published checkpoints, the real Qwen3 vocabulary and special
tokens, Qwen3 with 28 layers (so hidden layers 9/18/27 exist and one layer is cut by the exporter),
2 double + 2 single transformer blocks, a 4-level VAE with BatchNorm statistics that are not 0/1.

The initialisation makes every stage matter to the final image (see ../shared notes, and the test
`test_tiny_sensitivity`): linear weights at gain/sqrt(fan_in), with larger gains on the modulation
and the text projection, and QK-norm weights of 4, so that a wrong hidden layer, pad token, template,
seed or reference shows in the image.
"""

import math
import shutil
from pathlib import Path

import torch
from torch import nn

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
        elif hasattr(sub, "weight") and isinstance(getattr(sub, "weight"), nn.Parameter) and sub.weight.dim() == 1:
            # norms: weights around `gain` (QK norms use a large gain: sharp attention)
            with torch.no_grad():
                sub.weight.copy_(gain * (1.0 + 0.1 * torch.randn(sub.weight.shape, generator=generator)))
                if getattr(sub, "bias", None) is not None and isinstance(sub.bias, nn.Parameter):
                    sub.bias.copy_(0.1 * torch.randn(sub.bias.shape, generator=generator))


def build_tiny(out_dir, seed: int = 0, transformer_overrides=None, vae_overrides=None, qwen_overrides=None):
    """Write a tiny checkpoint to `out_dir` (which must not exist). Returns the path."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir}: already exists (choose a new directory)")
    g = torch.Generator("cpu").manual_seed(seed)

    qwen = Qwen3ForCausalLM(Qwen3Config(**{**TINY_QWEN3, **(qwen_overrides or {})})).eval()
    _init_(qwen, g, {"q_norm": 2.0, "k_norm": 2.0})

    transformer = Flux2Transformer2DModel(**{**TINY_TRANSFORMER, **(transformer_overrides or {})}).eval()
    _init_(transformer, g, {"norm_q": 4.0, "norm_k": 4.0, "norm_added_q": 4.0, "norm_added_k": 4.0, "modulation": 2.0, "context_embedder": 4.0})

    vae = AutoencoderKLFlux2(**{**TINY_VAE, **(vae_overrides or {})}).eval()
    _init_(vae, g, {})
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.5 * torch.randn(vae.bn.running_mean.shape, generator=g))
        vae.bn.running_var.copy_(0.5 + 1.5 * torch.rand(vae.bn.running_var.shape, generator=g))

    tokenizer = AutoTokenizer.from_pretrained(ASSETS)
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=qwen,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=True,
    )
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp)
    # The tokenizer files are copied verbatim (save_pretrained re-serialises them).
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ASSETS / name, tmp / "tokenizer" / name)
    tmp.rename(out_dir)
    return out_dir
