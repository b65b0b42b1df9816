"""Anima's denoiser (AnimaDenoiser) as pipeline layers: the text adapter with the transformer's
embedding -> Cosmos blocks -> head.

The first layer takes `AnimaSpec.make_inputs`' tuple
  (latents (B, 16, 1, h, w), t (B,) in [0, 1], qwen (B, L, D_qwen), qwen_mask (B, L),
   t5_ids (B, L) int64, t5_mask (B, L), grid)
runs the adapter as AnimaModularPipeline's text-conditioning step does (the Qwen3 states
cross-attended by learned queries of the T5 token ids, zeroed after the prompt and padded to
`min_sequence_length`) and hands Cosmos-Predict2's embedding layer (latents, t, text, grid); from
there on the layers are Cosmos-Predict2's own (`dpipe.models.common.cosmos_layers`), passing
(hidden, text, temb, embedded_timestep, grid). The adapter runs once per micro-batch on the
first stage; its gradient comes back through the text every block attends to.
"""

from __future__ import annotations

from torch import nn

from dpipe.models.common.cosmos_layers import CosmosEmbed, cosmos_layers
from dpipe.models.spec import PipelineLayer


class AnimaEmbed(CosmosEmbed):
    def __init__(self, transformer: nn.Module, text_conditioner: nn.Module):
        super().__init__(transformer)
        self.adopt("text_conditioner", text_conditioner, "text_conditioner")

    def forward(self, inputs):
        latents, t, qwen, qwen_mask, t5_ids, t5_mask, grid = inputs
        text = self.text_conditioner(source_hidden_states=qwen, target_input_ids=t5_ids,
                                     target_attention_mask=t5_mask,
                                     source_attention_mask=qwen_mask)
        return super().forward((latents, t, text.to(latents.dtype), grid))


def anima_layers(denoiser: nn.Module) -> list[PipelineLayer]:
    """Cosmos-Predict2's layers of `denoiser.transformer`, the first replaced by AnimaEmbed; every
    source name under the pipeline's component names (`transformer.`, `text_conditioner.`)."""
    layers = cosmos_layers(denoiser.transformer)
    layers[0] = AnimaEmbed(denoiser.transformer, denoiser.text_conditioner)
    for layer in layers:
        layer.source_names = {attr: name if name.startswith("text_conditioner")
                              else f"transformer.{name}"
                              for attr, name in layer.source_names.items()}
    return layers
