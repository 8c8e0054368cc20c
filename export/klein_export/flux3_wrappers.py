"""FLUX.3 Image Klein's exported graphs: one torch module each, with the contract's signature.

Each calls the real transformers/diffusers modules, computing what the modular pipeline's blocks
compute (`Flux3TextEncoderStep`, `Flux3Transformer2DModel.forward` with the ids of
`Flux3PrepareLatentsStep` and `Flux3PrepareImageCondLatentsStep`). The VAE graphs are FLUX.2's
(`wrappers.VaeEncoder`, `wrappers.VaeDecoder`): the decode and encode steps are the same.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn


class Flux3TextEncoder(nn.Module):
    """Qwen3-VL's language model: `[B, L]` ids and mask -> `[B, L, len(layers) * hidden]`, the
    stacked hidden states. Padding tokens get position id 1 (`Flux3TextEncoderStep` passes them so),
    and the model attends over the real tokens only.

    The model is cut after the last layer used. transformers returns the *final-normed* output as the
    last layer's hidden state: when the last layer used is the model's last, the norm is kept (that
    is what the pipeline stacks); when layers follow it, the cut model's norm is replaced by identity
    (the pipeline stacks that layer's raw output)."""

    def __init__(self, vl_model, hidden_layers, depth):
        super().__init__()
        self.hidden_layers = tuple(hidden_layers)
        last = max(self.hidden_layers)
        model = vl_model.model.language_model
        if last > len(model.layers):
            raise ValueError(f"hidden layer {last} requested but the text encoder has {len(model.layers)} layers")
        # As wrappers.TextEncoder: one forward of the original first, so that the copy inherits
        # transformers' mark of installed hidden-state hooks.
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long), output_hidden_states=True, use_cache=False)
        model = copy.copy(model)
        model._modules = dict(model._modules)
        model.layers = nn.ModuleList(list(model.layers)[:last])
        if last < depth:
            model.norm = nn.Identity()
        config = copy.deepcopy(model.config)
        config.num_hidden_layers = last
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:last]
        model.config = config
        self.model = model

    def forward(self, input_ids, attention_mask):
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device)[None].expand(batch, length)
        position_ids = positions.masked_fill(attention_mask == 0, 1)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=True,
            use_cache=False,
        )
        # [B, L, H] x n -> [B, L, n*H], as the step's stack + permute + reshape
        return torch.cat([out.hidden_states[k] for k in self.hidden_layers], dim=-1)


class Flux3Transformer(nn.Module):
    """Image tokens + text + reference tokens (possibly none) + timesteps + integer ids -> velocity.

    The ids come as the runtime's integers `(t, y, x, l)`; the graph scales the H and W axes by the
    recipe's `image_rope_scale` (0.5) in float32, as `_prepare_image_ids` does. Text ids are
    `(0, 0, 0, l)`. With no reference tokens the joint sequence is the one without references, so the
    graph computes the text-to-image forward too. A flow-map (step-distilled) model also takes the
    timestep each step jumps to.

    The forward is `Flux3Transformer2DModel.forward` with its blocks, with one change: diffusers
    computes each modulation (and the output norm's) on the timestep embedding expanded to every
    token, `[B, S, D]`, and every row of it is the same. Here it is computed once per image on
    `[B, D]` and broadcast: the same values, without a `[S, D] x [D, 3D]` product per mode (2% of a
    step's work), and the projections stay per-image products, which the exporter writes with the
    weight first and the quantizer leaves in float, as FLUX.2's (ort_fusions.weight_first_vector_products)."""

    def __init__(self, transformer, image_rope_scale):
        super().__init__()
        self.transformer = transformer
        self.register_buffer("scale", torch.tensor([1.0, image_rope_scale, image_rope_scale, 1.0]), persistent=False)

    def forward(self, latents, prompt_embeds, timestep, img_ids, txt_ids, cond_latents, cond_ids, target_timestep=None):
        return self.velocity(
            latents, prompt_embeds, timestep, img_ids, txt_ids, cond_latents, cond_ids, target_timestep, True
        )

    def velocity(self, latents, prompt_embeds, timestep, img_ids, txt_ids, cond_latents, cond_ids, target, with_cond):
        """`with_cond=False`: the reference tokens are left out (eager torch runs no empty reference
        tokens; the exported graph always has them, possibly none)."""
        tr = self.transformer
        batch, image_len = latents.shape[:2]

        def embed(embedder, t):
            return embedder(tr.time_proj(t * 1000).to(latents.dtype))  # [B, D]

        image_temb = embed(tr.timestep_embedder, timestep)
        zero_temb = embed(tr.timestep_embedder, torch.zeros_like(timestep))
        if target is not None:  # flow map: added to every mode's embedding
            target_temb = embed(tr.target_timestep_embedder, target)
            image_temb, zero_temb = image_temb + target_temb, zero_temb + target_temb
        image_act, zero_act = F.silu(image_temb), F.silu(zero_temb)

        def mods(name, act):  # the per-mode and joint modulations of one mode, [B, 1, 3D] each
            early, single = tr.early_stream_modulations[name], tr.single_stream_modulations[name]
            return early(act)[:, None], single(act)[:, None]

        txt_early, txt_single = mods("txt", zero_act)
        image_early, image_single = mods("image", image_act)
        txt = tr.context_embedder(prompt_embeds)
        image = tr.x_embedders["image"](latents)
        txt_rope = tr.pos_embed(txt_ids.to(torch.float32))
        image_rope = tr.pos_embed(img_ids.to(torch.float32) * self.scale)
        for block in tr.txt_mode_blocks:
            txt = block(txt, txt_early, txt_rope)
        for block in tr.mode_blocks["image"]:
            image = block(image, image_early, image_rope)
        content, content_mod, ropes = image, image_single.expand(batch, image_len, -1), [txt_rope, image_rope]
        if with_cond:
            cond_early, cond_single = mods("image_cond", zero_act)
            cond = tr.x_embedders["image_cond"](cond_latents)
            cond_rope = tr.pos_embed(cond_ids.to(torch.float32) * self.scale)
            for block in tr.mode_blocks["image_cond"]:
                cond = block(cond, cond_early, cond_rope)
            content = torch.cat([image, cond], dim=1)
            content_mod = torch.cat([content_mod, cond_single.expand(batch, cond.shape[1], -1)], dim=1)
            ropes.append(cond_rope)
        joint_rope = tuple(torch.cat([r[i] for r in ropes], dim=0) for i in (0, 1))
        for block in tr.single_transformer_blocks:
            txt, content = block(
                hidden_states=content,
                encoder_hidden_states=txt,
                temb_mod=content_mod,
                temb_mod_context=txt_single,
                image_rotary_emb=joint_rope,
            )
        norm = tr.norm_out  # Flux3AdaLayerNorm, on the per-image embedding
        scale, shift = norm.linear(norm.act_fn(image_temb))[:, None].chunk(2, dim=-1)
        return tr.proj_out(norm.norm(content[:, :image_len]) * (1 + scale) + shift)
