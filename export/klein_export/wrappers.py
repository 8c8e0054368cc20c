"""One torch module per exported graph, with the explicit signature of the I/O contract.

Each wrapper calls the real diffusers/transformers modules (and the pipeline's own static helpers for
patchify and packing), so the graphs compute what `Flux2KleinPipeline` computes.
"""

import copy

import torch
from diffusers import Flux2KleinPipeline
from torch import nn


class TextEncoder(nn.Module):
    """Qwen3 cut after the last hidden layer used: `[B, L]` ids and mask -> `[B, L, 3*hidden]`."""

    def __init__(self, causal_lm, hidden_layers):
        super().__init__()
        self.hidden_layers = tuple(hidden_layers)
        last = max(self.hidden_layers)
        model = causal_lm.model
        if last > len(model.layers):
            raise ValueError(f"hidden layer {last} requested but the text encoder has {len(model.layers)} layers")
        # transformers 5 installs its hidden-state hooks on the layers at a model's first forward and
        # marks that model as hooked. Run the original once first, so that the copy below inherits the
        # mark: else the copy and the original each hook the shared layers, and every hidden state is
        # recorded twice by whichever runs second (hidden_states[k] is then another layer's output).
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 1, dtype=torch.long), output_hidden_states=True, use_cache=False)
        # A shallow copy that owns the first `last` layers only. The final norm is replaced by identity:
        # transformers overwrites hidden_states[-1] with the normed output, and layer `last` is the last.
        model = copy.copy(model)
        model._modules = dict(model._modules)
        model.layers = nn.ModuleList(list(model.layers)[:last])
        model.norm = nn.Identity()
        config = copy.deepcopy(model.config)
        config.num_hidden_layers = last
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:last]
        model.config = config
        self.model = model

    def forward(self, input_ids, attention_mask):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
        # [B, L, H] x 3 -> [B, L, 3H], as the pipeline's stack + permute + reshape
        return torch.cat([out.hidden_states[k] for k in self.hidden_layers], dim=-1)


class Transformer(nn.Module):
    """Flux2 MM-DiT: packed latents + prompt embeddings + sigma + 2-D ids -> velocity."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer

    def forward(self, latents, prompt_embeds, timestep, img_ids, txt_ids):
        return self.transformer(
            hidden_states=latents,
            encoder_hidden_states=prompt_embeds,
            timestep=timestep,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=None,
            return_dict=False,
        )[0]


def _bn_stats(vae):
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    return mean, std


class VaeEncoder(nn.Module):
    """Image `[B, 3, H, W]` in [-1, 1] -> normalised patchified latents `[B, 128, H/16, W/16]`."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, image):
        z = self.vae.encode(image).latent_dist.mode()  # [B, 32, H/8, W/8], posterior mean
        z = Flux2KleinPipeline._patchify_latents(z)  # -> [B, 128, H/16, W/16]
        mean, std = _bn_stats(self.vae)
        return (z - mean) / std


class VaeDecoder(nn.Module):
    """Normalised patchified latents `[B, 128, h, w]` -> raw decoder output `[B, 3, 16h, 16w]`."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latents):
        mean, std = _bn_stats(self.vae)
        z = latents * std + mean
        z = Flux2KleinPipeline._unpatchify_latents(z)  # [B, 128, h, w] -> [B, 32, 2h, 2w]
        return self.vae.decode(z, return_dict=False)[0]
