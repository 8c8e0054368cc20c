"""FLUX.3 Image Klein's exported graphs: one torch module each, with the contract's signature.

Each calls the real transformers/diffusers modules, computing what the modular pipeline's blocks
compute (`Flux3TextEncoderStep`, `Flux3Transformer2DModel.forward` with the ids of
`Flux3PrepareLatentsStep` and `Flux3PrepareImageCondLatentsStep`). The VAE graphs are FLUX.2's
(`wrappers.VaeEncoder`, `wrappers.VaeDecoder`): the decode and encode steps are the same.
"""

import copy

import torch
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
    timestep each step jumps to."""

    def __init__(self, transformer, image_rope_scale):
        super().__init__()
        self.transformer = transformer
        self.register_buffer("scale", torch.tensor([1.0, image_rope_scale, image_rope_scale, 1.0]), persistent=False)

    def forward(self, latents, prompt_embeds, timestep, img_ids, txt_ids, cond_latents, cond_ids, target_timestep=None):
        return self.transformer(
            hidden_states=latents,
            encoder_hidden_states=prompt_embeds,
            timestep=timestep,
            img_ids=img_ids.to(torch.float32) * self.scale,
            txt_ids=txt_ids.to(torch.float32),
            image_cond_hidden_states=cond_latents,
            image_cond_ids=cond_ids.to(torch.float32) * self.scale,
            target_timestep=target_timestep,
            return_dict=False,
        )[0]
