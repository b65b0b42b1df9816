"""HiDream-I1's FLOPs per layer, modelled from its weights: what balances its pipeline stages
(`layer_costs`) and the benchmark's model FLOPs (`train_flops`).

Parameter counts mislead here: a single-stream block runs its weights over the image and text
tokens together, where a dual-stream block keeps the text's own, smaller share apart. So each
weight counts 2 FLOPs per token it sees, forward, and each block's joint attention 4 N^2 d (QK^T
and AV); biases, norms and LoRA adapters are left out.

The routed experts count twice over. In the model a token visits `num_activated_experts` of the
`num_routed_experts` experts of an MoE feed-forward: that is the model FLOPs, the useful work
(`executed=False`). dpipe's sync-free MoE (`moe.py`) runs every expert on every token: that is
what the GPU spends, and what balances the stages (`executed=True`).
"""

from __future__ import annotations

from torch import nn

from dpipe.models.adapters import is_adapter_param
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
BLOCKS = (HiDreamDualBlock, HiDreamSingleBlock)


def _joint_tokens(image_tokens: int, text_tokens: int) -> int:
    # The text stream is T5's projection and the last block's Llama projection; each block adds
    # its own Llama projection (diffusers' layout, dpipe.models.hidream.layers).
    return image_tokens + 3 * text_tokens


def weight_flops(layer: nn.Module, image_tokens: int, text_tokens: int, executed: bool) -> float:
    """Forward FLOPs of one sample through the layer's weights (its matmuls): those that run
    (`executed`) or the model's."""
    if not isinstance(layer, (*BLOCKS, HiDreamEmbed, HiDreamHead)):
        raise TypeError(f"no FLOP model for {type(layer).__name__}")
    joint = _joint_tokens(image_tokens, text_tokens)
    stream = joint if isinstance(layer, HiDreamSingleBlock) else image_tokens
    visited = {name: 1.0 if executed else moe.num_activated_experts / len(moe.experts)
               for name, moe in layer.named_modules() if hasattr(moe, "num_activated_experts")}
    flops = 0.0
    for name, param in layer.named_parameters():
        parts = name.split(".")
        if param.dim() < 2 or is_adapter_param(name):
            continue
        if "adaLN_modulation" in parts or "t_embedder" in parts or "p_embedder" in parts:
            tokens = 1  # the timestep and pooled conditioning: once per sample
        elif isinstance(layer, HiDreamEmbed):
            tokens = text_tokens if "caption_projection" in parts else image_tokens
        elif isinstance(layer, HiDreamDualBlock) and any(p in TEXT_STREAM_WEIGHTS for p in parts):
            tokens = joint - image_tokens
        else:
            tokens = stream
        if "experts" in parts:  # routed, not the shared expert
            tokens *= visited[name.split(".experts.")[0]]
        flops += 2 * param.numel() * tokens
    return flops


def attention_flops(layer: nn.Module, image_tokens: int, text_tokens: int) -> float:
    """Forward FLOPs of one sample's joint attention in the layer (none outside the blocks)."""
    if not isinstance(layer, BLOCKS):
        return 0.0
    joint = _joint_tokens(image_tokens, text_tokens)
    width = layer.block.block.attn1.to_q.weight.shape[0]  # heads x head dim
    return 4.0 * joint * joint * width


def layer_forward_flops(layers: list[nn.Module], image_tokens: int,
                        text_tokens: int) -> list[float]:
    """Forward FLOPs that run per layer for one sample; `text_tokens` is each text encoder's
    padded length."""
    return [weight_flops(layer, image_tokens, text_tokens, executed=True)
            + attention_flops(layer, image_tokens, text_tokens) for layer in layers]


def train_flops(layers: list[nn.Module], image_tokens: int, text_tokens: int,
                full: bool) -> float:
    """Model FLOPs of one sample's training step, by the benchmark's convention: the weights'
    forward, and their backward for the inputs (LoRA) or also for the weights (full): 2x or 3x
    the forward; attention's backward twice its forward."""
    return sum((3 if full else 2) * weight_flops(layer, image_tokens, text_tokens, executed=False)
               + 3 * attention_flops(layer, image_tokens, text_tokens) for layer in layers)
