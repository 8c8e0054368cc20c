"""The transformer of a KV checkpoint (`Flux2KleinKVPipeline`) as one graph for every step.

diffusers runs the KV variant's transformer in three modes (transformer_flux2.py): "extract" on the
first step (reference tokens first in the sequence, modulated at timestep 0, attending to themselves
only, their post-RoPE K/V of every block returned), "cached" on the later steps (no reference
tokens; the stored K/V are put between the text's and the image's in every attention), and the
plain forward when there are no references. Its modes branch on Python values, so one traced graph
cannot follow them. `KvTransformer` computes all three at once with zero-length tensors instead:

- `ref_latents [B, R, C]`, `ref_ids [R, 4]`: the reference tokens to extract (R = 0 otherwise);
- `cached_kv [layers, 2, B, K, heads*head_dim]`: the K/V of an earlier extract (K = 0 otherwise);
- output `ref_kv [layers, 2, B, R, heads*head_dim]`: the extracted K/V, double blocks first.

Every attention is then `[txt, img]` queries over `[txt, cached, ref, img]` keys, plus `ref` over
`ref`: with K = 0 that is diffusers' extract, with R = 0 its cached mode, with both 0 the plain
forward. The modulation blend and every module are diffusers' own; only the attention dispatch is
replaced, by the fused `klein::attention` (fused_attention.py).
"""

import torch
from diffusers.models.transformers import transformer_flux2 as tf
from torch import nn

from .fused_attention import attention


def _attend(query, key, value, num_txt, num_ref, cached, store):
    """`[B, S+R+T, H, D]` q/k/v in `[txt, ref, img]` order and `cached [2, B, K, H, D]` ->
    `[B, S+R+T, H, D]`. Appends the reference tokens' `(k, v)` to `store`."""
    heads = query.shape[2]
    ref = slice(num_txt, num_txt + num_ref)
    k_ref, v_ref = key[:, ref], value[:, ref]
    store.append((k_ref, v_ref))
    # [txt, img] over [txt, cached, ref, img]
    q_main = torch.cat([query[:, :num_txt], query[:, num_txt + num_ref :]], dim=1)
    k_all = torch.cat([key[:, :num_txt], cached[0], key[:, num_txt:]], dim=1)
    v_all = torch.cat([value[:, :num_txt], cached[1], value[:, num_txt:]], dim=1)
    main = attention(q_main, k_all, v_all, heads)
    # ref over ref only
    own = attention(query[:, ref], k_ref, v_ref, heads)
    return torch.cat([main[:, :num_txt], own, main[:, num_txt:]], dim=1)


class KvDoubleProcessor:
    """`Flux2KVAttnProcessor` with `_attend` for its three modes."""

    def __call__(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        image_rotary_emb=None,
        cached=None,
        num_ref=None,
        store=None,
    ):
        query, key, value, e_query, e_key, e_value = tf._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in (query, key, value))
        query, key = attn.norm_q(query), attn.norm_k(key)
        e_query, e_key, e_value = (t.unflatten(-1, (-1, attn.head_dim)) for t in (e_query, e_key, e_value))
        e_query, e_key = attn.norm_added_q(e_query), attn.norm_added_k(e_key)
        # [B, S, H, D] ; [B, R+T, H, D] -> [B, S+R+T, H, D]
        query, key, value = (torch.cat(pair, dim=1) for pair in ((e_query, query), (e_key, key), (e_value, value)))
        query = tf.apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = tf.apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        num_txt = encoder_hidden_states.shape[1]
        hidden_states = _attend(query, key, value, num_txt, num_ref, cached, store).flatten(2, 3).to(query.dtype)
        encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
            [num_txt, hidden_states.shape[1] - num_txt], dim=1
        )
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        return hidden_states, encoder_hidden_states


class KvSingleProcessor:
    """`Flux2KVParallelSelfAttnProcessor` with `_attend` for its three modes."""

    def __call__(
        self,
        attn,
        hidden_states,
        attention_mask=None,
        image_rotary_emb=None,
        cached=None,
        num_ref=None,
        num_txt=None,
        store=None,
    ):
        projected = attn.to_qkv_mlp_proj(hidden_states)
        qkv, mlp = torch.split(projected, [3 * attn.inner_dim, attn.mlp_hidden_dim * attn.mlp_mult_factor], dim=-1)
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
        query, key = attn.norm_q(query), attn.norm_k(key)
        query = tf.apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = tf.apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        out = _attend(query, key, value, num_txt, num_ref, cached, store).flatten(2, 3).to(query.dtype)
        return attn.to_out(torch.cat([out, attn.mlp_act_fn(mlp)], dim=-1))


class KvTransformer(nn.Module):
    """The KV checkpoint's MM-DiT in all three modes (module docstring): `diffusers`' forward with
    `kv_cache_mode` "extract" or "cached" or none, by the lengths of `ref_latents` and `cached_kv`."""

    def __init__(self, transformer):
        super().__init__()
        self.transformer = transformer
        for block in transformer.transformer_blocks:
            block.attn.set_processor(KvDoubleProcessor())
        for block in transformer.single_transformer_blocks:
            block.attn.set_processor(KvSingleProcessor())

    def forward(self, latents, prompt_embeds, timestep, img_ids, txt_ids, ref_latents, ref_ids, cached_kv):
        t = self.transformer
        num_txt, num_ref = prompt_embeds.shape[1], ref_latents.shape[1]
        timestep = timestep.to(latents.dtype) * 1000
        temb = t.time_guidance_embed(timestep, None)
        ref_temb = t.time_guidance_embed(torch.zeros_like(timestep), None)  # ref_fixed_timestep 0
        hidden = torch.cat([ref_latents, latents], dim=1)  # [B, R+T, C]
        mod_img = tf._blend_double_block_mods(
            t.double_stream_modulation_img(temb), t.double_stream_modulation_img(ref_temb), num_ref, hidden.shape[1]
        )
        mod_txt = t.double_stream_modulation_txt(temb)
        hidden = t.x_embedder(hidden)
        encoder = t.context_embedder(prompt_embeds)
        image_rot = t.pos_embed(torch.cat([ref_ids, img_ids], dim=0))
        text_rot = t.pos_embed(txt_ids)
        rotary = tuple(torch.cat([a, b], dim=0) for a, b in zip(text_rot, image_rot, strict=True))
        # [layers, 2, B, K, H*D] -> [layers, 2, B, K, H, D]
        heads, head_dim = t.config.num_attention_heads, t.config.attention_head_dim
        cached = cached_kv.unflatten(-1, (heads, head_dim))
        store = []
        for i, block in enumerate(t.transformer_blocks):
            kwargs = {"cached": cached[i], "num_ref": num_ref, "store": store}
            encoder, hidden = block(hidden, encoder, mod_img, mod_txt, rotary, kwargs)
        hidden = torch.cat([encoder, hidden], dim=1)  # [B, S+R+T, dim]
        mod_single = tf._blend_single_block_mods(
            t.single_stream_modulation(temb), t.single_stream_modulation(ref_temb), num_txt, num_ref, hidden.shape[1]
        )
        first = len(t.transformer_blocks)
        for i, block in enumerate(t.single_transformer_blocks):
            kwargs = {"cached": cached[first + i], "num_ref": num_ref, "num_txt": num_txt, "store": store}
            hidden = block(hidden, None, mod_single, rotary, kwargs)
        hidden = hidden[:, num_txt + num_ref :]
        velocity = t.proj_out(t.norm_out(hidden, temb))
        # [B, R, H, D] pairs -> [layers, 2, B, R, H*D]
        # (every size given: a reshape cannot infer -1 of an empty tensor)
        flat = (latents.shape[0], num_ref, heads * head_dim)
        ref_kv = torch.stack([torch.stack([k.reshape(flat), v.reshape(flat)]) for k, v in store])
        return velocity, ref_kv


def kv_layers(config) -> int:
    """The blocks whose reference K/V are cached: every double and single block."""
    return config.num_layers + config.num_single_layers
