"""LoRA files for the tests, in every layout diffusers 0.42.1's `Flux2LoraLoaderMixin` reads.

The PEFT file is written by diffusers itself (`add_adapter`, `get_peft_model_state_dict`,
`save_lora_weights` with the adapter's metadata). The other layouts are built from random factors
with the trainers' own key names: BFL/ai-toolkit (`diffusion_model.double_blocks.N.img_attn.qkv`),
kohya (`lora_unet_double_blocks_N_img_attn_qkv.lora_down.weight` + `alpha`), BFL LoKr and LyCORIS
LoKr. A fused QKV LoRA has one `lora_A` for the three projections (what the BFL layout stores).
"""

import torch
from safetensors.torch import save_file

# BFL double-block paths -> diffusers paths (lora_conversion_utils.py, inverted)
BFL_DOUBLE = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn.proj": ("attn.to_out.0",),
    "txt_attn.proj": ("attn.to_add_out",),
    "img_mlp.0": ("ff.linear_in",),
    "img_mlp.2": ("ff.linear_out",),
    "txt_mlp.0": ("ff_context.linear_in",),
    "txt_mlp.2": ("ff_context.linear_out",),
}
BFL_SINGLE = {"linear1": "attn.to_qkv_mlp_proj", "linear2": "attn.to_out"}
BFL_EXTRA = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
}
KOHYA_EXTRA = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in_in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in_out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "final_layer_linear": "proj_out",
}
LYCORIS = {
    "attn_to_q": "attn.to_q",
    "attn_to_k": "attn.to_k",
    "attn_to_v": "attn.to_v",
    "attn_to_out_0": "attn.to_out.0",
    "attn_to_add_out": "attn.to_add_out",
    "attn_add_q_proj": "attn.add_q_proj",
    "attn_add_k_proj": "attn.add_k_proj",
    "attn_add_v_proj": "attn.add_v_proj",
    "attn_to_qkv_mlp_proj": "attn.to_qkv_mlp_proj",
    "attn_to_out": "attn.to_out",
    "ff_linear_in": "ff.linear_in",
    "ff_linear_out": "ff.linear_out",
    "ff_context_linear_in": "ff_context.linear_in",
    "ff_context_linear_out": "ff_context.linear_out",
}


def linear_shapes(transformer) -> dict:
    """diffusers module name -> (out, in) of every linear layer."""
    return {n: tuple(m.weight.shape) for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}


def bfl_names(shapes):
    """(BFL path, diffusers modules) of every layer a BFL file can hold."""
    cfg_double = sorted({int(n.split(".")[1]) for n in shapes if n.startswith("transformer_blocks.")})
    cfg_single = sorted({int(n.split(".")[1]) for n in shapes if n.startswith("single_transformer_blocks.")})
    for i in cfg_double:
        for path, modules in BFL_DOUBLE.items():
            yield f"double_blocks.{i}.{path}", [f"transformer_blocks.{i}.{m}" for m in modules]
    for i in cfg_single:
        for path, module in BFL_SINGLE.items():
            yield f"single_blocks.{i}.{path}", [f"single_transformer_blocks.{i}.{module}"]
    for path, module in BFL_EXTRA.items():
        if module in shapes:
            yield path, [module]


def _fused_shape(shapes, modules):
    out = sum(shapes[m][0] for m in modules)
    return out, shapes[modules[0]][1]


def write_peft(transformer, path, rank=4, alpha=8, std=0.1, seed=0, pipeline=None):
    """A LoRA on every linear layer, made and saved by diffusers/PEFT (metadata: r, lora_alpha), with
    `pipeline`'s `save_lora_weights` (default Flux2KleinPipeline's)."""
    from diffusers import Flux2KleinPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    targets = sorted(linear_shapes(transformer))
    torch.manual_seed(seed)
    transformer.add_adapter(
        LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights=False, target_modules=targets), adapter_name="made"
    )
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)
    state = get_peft_model_state_dict(transformer, adapter_name="made")
    metadata = transformer.peft_config["made"].to_dict()
    transformer.delete_adapters("made")
    (pipeline or Flux2KleinPipeline).save_lora_weights(
        str(path.parent),
        transformer_lora_layers=state,
        weight_name=path.name,
        transformer_lora_adapter_metadata=metadata,
    )
    return path


def write_bfl(shapes, path, rank=4, std=0.1, seed=1, prefix="diffusion_model."):
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for bfl, modules in bfl_names(shapes):
        out, inp = _fused_shape(shapes, modules)
        tensors[f"{prefix}{bfl}.lora_A.weight"] = torch.randn(rank, inp, generator=g) * std
        tensors[f"{prefix}{bfl}.lora_B.weight"] = torch.randn(out, rank, generator=g) * std
    save_file(tensors, str(path))
    return path


def write_kohya(shapes, path, rank=4, alpha=2.0, std=0.1, seed=2, dtype=torch.float16):
    """kohya sd-scripts names, fp16 factors, alpha != rank (scale alpha / rank)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    layers = [(bfl, modules) for bfl, modules in bfl_names(shapes) if "blocks." in bfl]
    layers += [(k, [v]) for k, v in KOHYA_EXTRA.items() if v in shapes]
    for bfl, modules in layers:
        name = "lora_unet_" + bfl.replace(".", "_")
        out, inp = _fused_shape(shapes, modules)
        tensors[f"{name}.lora_down.weight"] = (torch.randn(rank, inp, generator=g) * std).to(dtype)
        tensors[f"{name}.lora_up.weight"] = (torch.randn(out, rank, generator=g) * std).to(dtype)
        tensors[f"{name}.alpha"] = torch.tensor(alpha)
    save_file(tensors, str(path))
    return path


def _lokr_factors(out, inp, g, std, rank, factor=4):
    """w1 [factor, factor] whole; w2 [out/factor, in/factor] as w2_a . w2_b of `rank` (or whole)."""
    w1 = torch.randn(factor, factor, generator=g) * std
    if rank is None:
        return {"lokr_w1": w1, "lokr_w2": torch.randn(out // factor, inp // factor, generator=g) * std}
    return {
        "lokr_w1": w1,
        "lokr_w2_a": torch.randn(out // factor, rank, generator=g) * std,
        "lokr_w2_b": torch.randn(rank, inp // factor, generator=g) * std,
    }


def write_lokr_bfl(shapes, path, rank=2, alpha=4.0, std=0.3, seed=3):
    """BFL LoKr: fused QKV of the double blocks (diffusers fuses the model's projections for it)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for bfl, modules in bfl_names(shapes):
        out, inp = _fused_shape(shapes, modules)
        for suffix, t in _lokr_factors(out, inp, g, std, rank).items():
            tensors[f"diffusion_model.{bfl}.{suffix}"] = t
        tensors[f"diffusion_model.{bfl}.alpha"] = torch.tensor(alpha)
    save_file(tensors, str(path))
    return path


def write_lokr_lycoris(shapes, path, std=0.2, seed=4):
    """LyCORIS LoKr on the blocks' layers, both factors whole (no alpha scaling)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out, inp) in shapes.items():
        parts = module.split(".")
        if parts[0] not in ("transformer_blocks", "single_transformer_blocks"):
            continue
        sub = "_".join(parts[2:])
        if sub not in LYCORIS:
            continue
        key = f"lycoris_{parts[0]}_{parts[1]}_{sub}"
        for suffix, t in _lokr_factors(out, inp, g, std, None).items():
            tensors[f"{key}.{suffix}"] = t
    save_file(tensors, str(path))
    return path
