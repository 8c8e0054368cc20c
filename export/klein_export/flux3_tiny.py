"""Random-weight FLUX.3 Image Klein checkpoints built with the real diffusers/transformers classes.

Written by diffusers' own `ModularPipeline.save_pretrained` (`modular_model_index.json`, the
processor's `processor_config.json` and `chat_template.jinja`), with the real Qwen3 vocabulary and
the Qwen3-VL Instruct chat template (assets/qwen3-vl/PROVENANCE.md).

- `flux3-tiny`: the test model. Qwen3-VL's language model has 32 layers of width 16, so that the
  pipeline's default out layers 4, 8, ..., 32 exist and the last one is the final-normed output
  (what transformers returns for the last layer); 1 per-mode block and 2 joint blocks.
- `flux3-wide`: the published widths (Qwen3-VL-4B's 2560, 24 heads x 128, joint dim 20480) with 8
  language-model layers (out layers 1..8, recorded in the index) and 1 + 2 blocks.
- `flux3`: the published architecture (5 per-mode blocks, 28 joint blocks, 36 Qwen3-VL layers).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .atomic import atomic_directory, check_output
from .errors import OutputExistsError
from .flux3 import DEFAULT_OUT_LAYERS, OUT_LAYERS_KEY
from .tiny import ASSETS, FULL_VAE, TINY_VAE, _init_

VL_ASSETS = ASSETS.parent / "qwen3-vl"

TINY_TEXT = dict(
    vocab_size=151936,
    hidden_size=16,
    intermediate_size=48,
    num_hidden_layers=32,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    max_position_embeddings=16384,
    rms_norm_eps=1e-6,
    # mrope sections of a head of 8 (3 x 4 frequencies); the text path gives all three the same ids.
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    tie_word_embeddings=True,
)
TINY_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=16,
    num_position_embeddings=64,
    deepstack_visual_indexes=[0],
)
TINY_TRANSFORMER = dict(
    in_channels=128,
    cond_in_channels=128,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=8 * 16,
    axes_dims_rope=(8, 8, 8, 8),
    rope_theta=2000,
)
# Qwen3-VL-4B-Instruct's language model and vision tower.
FULL_TEXT = dict(
    TINY_TEXT,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=262144,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [24, 20, 20],
        "mrope_interleaved": True,
    },
)
FULL_VISION = dict(
    depth=24,
    hidden_size=1024,
    intermediate_size=4096,
    num_heads=16,
    out_hidden_size=2560,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[5, 11, 17],
)
FULL_TRANSFORMER = dict(
    TINY_TRANSFORMER,
    num_layers=5,
    num_single_layers=28,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=20480,
    axes_dims_rope=(32, 32, 32, 32),
    rope_theta=10000,
)


@dataclass(frozen=True)
class Preset:
    text: dict
    vision: dict
    transformer: dict
    vae: dict
    storage: str
    out_layers: tuple = None  # recorded in the index when not the pipeline's default


PRESETS = {
    "flux3-tiny": Preset(TINY_TEXT, TINY_VISION, TINY_TRANSFORMER, TINY_VAE, "float32"),
    "flux3-wide": Preset(
        dict(FULL_TEXT, num_hidden_layers=8),
        TINY_VISION | {"out_hidden_size": 2560},
        dict(FULL_TRANSFORMER, num_layers=1, num_single_layers=2),
        FULL_VAE,
        "bfloat16",
        tuple(range(1, 9)),
    ),
    "flux3": Preset(FULL_TEXT, FULL_VISION, FULL_TRANSFORMER, FULL_VAE, "bfloat16"),
}


def processor(chat_template=None):
    """A Qwen3VLProcessor with the bundled Qwen3 vocabulary and the Qwen3-VL chat template."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    template = chat_template or (VL_ASSETS / "chat_template.jinja").read_text(encoding="utf-8")
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2),
        tokenizer=AutoTokenizer.from_pretrained(str(ASSETS)),
        video_processor=Qwen3VLVideoProcessor(),
        chat_template=template,
    )


def build_flux3(
    out_dir,
    seed=0,
    preset="flux3-tiny",
    distilled=True,
    transformer_overrides=None,
    text_overrides=None,
    out_layers=None,
):
    """Write a random-weight FLUX.3 checkpoint of `preset` to `out_dir` (which must not exist):
    step-distilled (`flow_map`) or base. `out_layers`: the stacked text encoder layers, recorded in
    the index when not the pipeline's default (default: the preset's)."""
    from diffusers import AutoencoderKLFlux2, Flux3Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    out_dir = Path(out_dir)
    if out_dir.exists():
        raise OutputExistsError(f"{out_dir}: already exists (choose a new directory)")
    check_output(out_dir, force=False)
    spec = PRESETS[preset]
    dtype = getattr(torch, spec.storage)
    with atomic_directory(out_dir) as tmp:
        g = torch.Generator("cpu").manual_seed(seed)

        def save(model, component):
            if dtype != torch.float32:
                model.to(dtype)
            model.save_pretrained(tmp / component)

        text = {**spec.text, **(text_overrides or {})}
        config = Qwen3VLConfig(
            text_config=text, vision_config=spec.vision, tie_word_embeddings=text["tie_word_embeddings"]
        )
        config.architectures = ["Qwen3VLForConditionalGeneration"]
        te = Qwen3VLForConditionalGeneration(config).eval()
        _init_(te, g, {"q_norm": 2.0, "k_norm": 2.0})
        save(te, "text_encoder")
        del te

        cfg = {**spec.transformer, "flow_map": distilled, **(transformer_overrides or {})}
        transformer = Flux3Transformer2DModel(**cfg).eval()
        _init_(transformer, g, {"norm_q": 4.0, "norm_k": 4.0, "modulations": 2.0, "context_embedder": 4.0})
        save(transformer, "transformer")
        del transformer

        vae = AutoencoderKLFlux2(**spec.vae).eval()
        _init_(vae, g, {})
        with torch.no_grad():
            vae.bn.running_mean.copy_(0.5 * torch.randn(vae.bn.running_mean.shape, generator=g))
            vae.bn.running_var.copy_(0.5 + 1.5 * torch.rand(vae.bn.running_var.shape, generator=g))
        save(vae, "vae")
        del vae

        processor().save_pretrained(tmp / "tokenizer")
        index = _index(distilled)
        out_layers = spec.out_layers if out_layers is None else tuple(out_layers)
        if out_layers is not None and tuple(out_layers) != DEFAULT_OUT_LAYERS:
            index[OUT_LAYERS_KEY] = list(out_layers)
        (tmp / "modular_model_index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return out_dir


def _index(distilled: bool) -> dict:
    """What `ModularPipeline.save_pretrained` writes, with each component's loading spec pointing at
    its subfolder of this checkpoint (`pretrained_model_name_or_path` null: the checkpoint itself)."""
    import diffusers

    classes = {
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "tokenizer": ["transformers", "Qwen3VLProcessor"],
        "transformer": ["diffusers", "Flux3Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
    }
    prefix = "Flux3Distilled" if distilled else "Flux3"
    index = {
        "_blocks_class_name": f"{prefix}AutoBlocks",
        "_class_name": f"{prefix}ModularPipeline",
        "_diffusers_version": diffusers.__version__,
    }
    for name, (library, cls) in classes.items():
        spec = {
            "pretrained_model_name_or_path": None,
            "revision": None,
            "subfolder": name,
            "type_hint": [library, cls],
            "variant": None,
        }
        index[name] = [library, cls, spec]
    return index
