"""HiDream's MoE feed-forward without host syncs: every routed expert runs on every token, and the
gate's weights (zero for the experts a token was not routed to) combine their outputs.

diffusers' training path picks each expert's tokens by a boolean mask (`x[idx == i]`), whose size
depends on the routing: a host sync per expert, twice per MoE feed-forward, forward and backward,
and a graph break in every compiled block. On one H200 the 17B model's LoRA step made 7296 host
syncs and ran at 13% MFU (docs/performance.md, "HiDream-I1").

The price is compute: a token visits all `num_routed_experts` experts, not `num_activated_experts`
of them, about 1.6x the block's FLOPs at HiDream-I1's sizes (`costs.py` counts what runs). The
result is diffusers' to the last bit on the CPU: an unselected expert's output is multiplied by an
exact zero, and the two selected ones are summed as diffusers sums them.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU
from torch import nn


class SyncFreeMoE(MOEFeedForwardSwiGLU):
    """diffusers' module with its weights and names as they are; only `forward` differs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        expert_ids, gate_weights, _aux_loss = self.gate(x)  # (tokens, k) each
        tokens = x.view(-1, x.shape[-1])
        # combine[t, e]: token t's gate weight for expert e; zero where e is not among its k.
        combine = gate_weights.new_zeros(tokens.shape[0], len(self.experts))
        combine = combine.scatter(1, expert_ids, gate_weights)
        routed = sum(expert(tokens).to(dtype) * combine[:, e:e + 1]
                     for e, expert in enumerate(self.experts))
        return routed.view(x.shape).to(dtype) + self.shared_experts(x)


def make_sync_free(transformer: nn.Module) -> None:
    """Give every MoE feed-forward of `transformer` the sync-free forward, in place."""
    for module in transformer.modules():
        if type(module) is MOEFeedForwardSwiGLU:
            module.__class__ = SyncFreeMoE
