"""HiDream-I1's stage-balancing costs: each layer's forward FLOPs, modelled from its weights.

Parameter counts mislead twice here. A token visits `num_activated_experts` of the
`num_routed_experts` experts of an MoE feed-forward, not all of them; and a single-stream block
runs its weights over the image and text tokens together, where a dual-stream block keeps the
text's own, smaller share apart. So each weight counts 2 FLOPs per token it sees, and each
block's joint attention 4 N^2 d (QK^T and AV); biases and norms are left out.
"""

from __future__ import annotations

from torch import nn

from dpipe.models.hidream.layers import (
    HiDreamDualBlock,
    HiDreamEmbed,
    HiDreamHead,
    HiDreamSingleBlock,
)

# A 1024x1024 image: 128x128 latents in 2x2 patches. Training at other sizes moves the balance
# little: image tokens dominate both kinds of block.
NOMINAL_IMAGE_TOKENS = 4096
TEXT_STREAM_WEIGHTS = ("to_q_t", "to_k_t", "to_v_t", "to_out_t", "ff_t")


def layer_forward_flops(layers: list[nn.Module], image_tokens: int,
                        text_tokens: int) -> list[float]:
    """Forward FLOPs per layer for one sample; `text_tokens` is each text encoder's padded
    length."""
    # The text stream is T5's projection and the last block's Llama projection; each block adds
    # its own Llama projection (diffusers' layout, dpipe.models.hidream.layers).
    text = 3 * text_tokens
    joint = image_tokens + text
    costs = []
    for layer in layers:
        stream = joint if isinstance(layer, HiDreamSingleBlock) else image_tokens
        visited = {name: moe.num_activated_experts / len(moe.experts)  # per MoE feed-forward
                   for name, moe in layer.named_modules() if hasattr(moe, "num_activated_experts")}
        flops = 0.0
        for name, param in layer.named_parameters():
            if param.dim() < 2:
                continue
            parts = name.split(".")
            if "adaLN_modulation" in parts or "t_embedder" in parts or "p_embedder" in parts:
                tokens = 1  # the timestep and pooled conditioning: once per sample
            elif isinstance(layer, HiDreamEmbed):
                tokens = text_tokens if "caption_projection" in parts else image_tokens
            elif isinstance(layer, HiDreamDualBlock) and any(p in TEXT_STREAM_WEIGHTS for p in parts):
                tokens = text
            else:
                tokens = stream
            if "experts" in parts:  # routed, not the shared expert
                tokens *= visited[name.split(".experts.")[0]]
            flops += 2 * param.numel() * tokens
        if isinstance(layer, (HiDreamDualBlock, HiDreamSingleBlock)):
            width = layer.block.block.attn1.to_q.weight.shape[0]  # heads x head dim
            flops += 4 * joint * joint * width
        elif not isinstance(layer, (HiDreamEmbed, HiDreamHead)):
            raise TypeError(f"no cost model for {type(layer).__name__}")
        costs.append(flops)
    return costs
