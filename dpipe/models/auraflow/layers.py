"""AuraFlow's transformer as pipeline layers: embed -> joint blocks -> single blocks -> head.

Every layer passes (hidden, text_hidden, temb, size). The single (DiT) blocks run on the
concatenation [text; image] as in diffusers; each one concatenates and splits again, which is exact,
so every layer keeps one tuple layout. `size` carries the latent (height, width) in its shape
(`sync_free.carrier`), read on any stage without a host sync.
"""

from __future__ import annotations

import torch
from torch import nn

from dpipe.models.common.stage_io import keep_in_graph, needs_grad
from dpipe.models.spec import PipelineLayer
from dpipe.models.sync_free import carrier, sizes


class AuraFlowEmbed(PipelineLayer):
    def __init__(self, transformer: nn.Module):
        super().__init__()
        for name in ("pos_embed", "time_step_embed", "time_step_proj", "context_embedder"):
            self.adopt(name, getattr(transformer, name), name)
        # A bare parameter of the transformer: held directly, exported under its own name.
        self.adopt("register_tokens", transformer.register_tokens, "register_tokens")

    def forward(self, inputs):
        latents, t, text = inputs
        h, w = latents.shape[-2:]
        hidden = self.pos_embed(latents)
        # The pipeline passes sigma in [0, 1]; `time_step_embed` scales it by 1000 itself.
        temb = self.time_step_proj(self.time_step_embed(t).to(hidden.dtype))
        text_hidden = self.context_embedder(text)
        registers = self.register_tokens.to(text_hidden.dtype)
        text_hidden = torch.cat([registers.expand(text_hidden.shape[0], -1, -1), text_hidden], 1)
        size = carrier(h, w, device=latents.device)
        return needs_grad(hidden.contiguous()), needs_grad(text_hidden), needs_grad(temb), size

    def denoiser_state_dict(self, trainable_only: bool) -> dict[str, torch.Tensor]:
        out = {}
        for name, param in self.named_parameters():
            if trainable_only and not param.requires_grad:
                continue
            if name == "register_tokens":
                out[name] = param.detach()
            else:
                attr, rest = name.split(".", 1)
                out[f"{self.source_names[attr]}.{rest}"] = param.detach()
        return out


class AuraFlowJointBlock(PipelineLayer):
    def __init__(self, block: nn.Module, source_name: str):
        super().__init__()
        self.adopt("block", block, source_name)

    def forward(self, inputs):
        hidden, text_hidden, temb, size = inputs
        text_hidden, hidden = self.block(hidden_states=hidden, encoder_hidden_states=text_hidden,
                                         temb=temb)
        return hidden, text_hidden, temb, size


class AuraFlowSingleBlock(PipelineLayer):
    def __init__(self, block: nn.Module, source_name: str):
        super().__init__()
        self.adopt("block", block, source_name)

    def forward(self, inputs):
        hidden, text_hidden, temb, size = inputs
        n_text = text_hidden.shape[1]
        combined = self.block(hidden_states=torch.cat([text_hidden, hidden], 1), temb=temb)
        # Slices of the joint sequence; tensors sent between stages must be contiguous.
        return combined[:, n_text:].contiguous(), combined[:, :n_text].contiguous(), temb, size


class AuraFlowHead(PipelineLayer):
    def __init__(self, transformer: nn.Module):
        super().__init__()
        self.adopt("norm_out", transformer.norm_out, "norm_out")
        self.adopt("proj_out", transformer.proj_out, "proj_out")
        self.patch = int(transformer.config.patch_size)
        self.out_channels = int(transformer.config.out_channels)

    def forward(self, inputs):
        hidden, text_hidden, temb, size = inputs
        out = self.proj_out(self.norm_out(hidden, temb))
        p, c = self.patch, self.out_channels
        h, w = (n // p for n in sizes(size))
        out = out.reshape(out.shape[0], h, w, p, p, c).permute(0, 5, 1, 3, 2, 4)
        out = out.reshape(out.shape[0], c, h * p, w * p)
        # The text stream ends unused; it still needs a gradient when it crossed a stage boundary.
        return keep_in_graph(out, text_hidden)


def auraflow_layers(transformer: nn.Module) -> list[PipelineLayer]:
    layers: list[PipelineLayer] = [AuraFlowEmbed(transformer)]
    for i, block in enumerate(transformer.joint_transformer_blocks):
        layers.append(AuraFlowJointBlock(block, f"joint_transformer_blocks.{i}"))
    for i, block in enumerate(transformer.single_transformer_blocks):
        layers.append(AuraFlowSingleBlock(block, f"single_transformer_blocks.{i}"))
    layers.append(AuraFlowHead(transformer))
    return layers
