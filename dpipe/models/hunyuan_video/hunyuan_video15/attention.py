"""HunyuanVideo 1.5's joint attention with the text mask on the keys only, and no mask at all when
no text is padded.

diffusers' processor (`HunyuanVideo15AttnProcessor2_0`) always builds a (B, 1, S, S) boolean
query x key mask from the text mask, S the video and text tokens together: 2.5 GB per sample and
call for a 5-second 480p clip (~50k tokens), and any mask keeps SDPA off its flash kernel. Masking
only the keys gives every real token the same output: a padded token never attends to it, and
what the padded queries compute reaches no real token (their keys are masked in every block) nor
the output. Otherwise this is diffusers' processor: projections, norms, rotary, the kernel chosen
by `model.attention` through diffusers' dispatcher.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video15 import (
    HunyuanVideo15AttnProcessor2_0)
from torch import nn


class KeyPaddingAttention(HunyuanVideo15AttnProcessor2_0):
    """Takes what diffusers' processor takes, `attention_mask` being the (B, text tokens) mask of
    the text keys, or None."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None):
        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(2, (attn.heads, -1))

        query = attn.norm_q(heads(attn.to_q(hidden_states)))
        key = attn.norm_k(heads(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        if image_rotary_emb is not None:  # on the video tokens only
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        text_query = heads(attn.add_q_proj(encoder_hidden_states))
        text_key = heads(attn.add_k_proj(encoder_hidden_states))
        if attn.norm_added_q is not None:
            text_query = attn.norm_added_q(text_query)
        if attn.norm_added_k is not None:
            text_key = attn.norm_added_k(text_key)
        query = torch.cat([query, text_query], dim=1)
        key = torch.cat([key, text_key], dim=1)
        value = torch.cat([value, heads(attn.add_v_proj(encoder_hidden_states))], dim=1)

        if attention_mask is not None:  # every video key is real: True before the text's
            pad = query.shape[1] - attention_mask.shape[1]
            attention_mask = F.pad(attention_mask.bool(), (pad, 0), value=True)[:, None, None, :]
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                    is_causal=False, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        video, text = out[:, :hidden_states.shape[1]], out[:, hidden_states.shape[1]:]
        return attn.to_out[1](attn.to_out[0](video)), attn.to_add_out(text)


def mask_keys_only(transformer: nn.Module) -> None:
    """Give every joint attention of `transformer` the key-padding processor, in place (keeping
    the kernel `set_attention_backend` chose)."""
    for module in transformer.modules():
        if type(getattr(module, "processor", None)) is HunyuanVideo15AttnProcessor2_0:
            module.processor.__class__ = KeyPaddingAttention
