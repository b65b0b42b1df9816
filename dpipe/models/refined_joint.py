"""FLOPs of the transformers that refine each stream alone before joining them (Z-Image,
Lumina 2): the benchmark's model-FLOP convention for the whole step, and the forward FLOPs per
pipeline layer that balance their stages.

    embed -> refiner blocks over the image tokens, and over the text tokens, each alone
          -> join -> blocks over both -> head

Parameter counts (the default layer cost) misweigh them: a text refiner holds a block's weights
but runs them over the caption's few tokens, and the timestep embedder's wide MLP runs once per
sample. So each weight counts 2 FLOPs per token it sees, forward, and each attention 4 N^2 d
(QK^T and AV); norms, biases and LoRA adapters are left out.
"""

from __future__ import annotations

from torch import nn

from dpipe.models.adapters import is_adapter_param
from dpipe.models.spec import PipelineLayer, attention_train_flops, model_params

# A 1024x1024 image: 128x128 latents in 2x2 patches, the resolution both families train at.
NOMINAL_IMAGE_TOKENS = 4096


def refined_joint_train_flops(denoiser: nn.Module, batch: int, image_tokens: int,
                              text_tokens: int, width: int, timestep_embedder: nn.Module,
                              full: bool) -> float:
    """The benchmark's model-FLOP convention (`ModelSpec.train_flops`): `noise_refiner` blocks
    over the image tokens, `context_refiner` blocks over the text, then `layers` over both
    joined. The timestep embedder runs once per sample; the other embedders and the head count
    for every joint token, an upper bound. `width`: the query heads x head dim."""
    joint = image_tokens + text_tokens
    streams = [(denoiser.noise_refiner, image_tokens), (denoiser.context_refiner, text_tokens),
               (denoiser.layers, joint), (timestep_embedder, 1)]
    rest = model_params(denoiser) - sum(model_params(part) for part, _ in streams)
    weights = rest * joint + sum(model_params(part) * tokens for part, tokens in streams)
    attention = sum(len(blocks) * attention_train_flops(seq, width)
                    for blocks, seq in streams[:3])
    return batch * ((6 if full else 4) * weights + attention)


def layer_forward_flops(layers: list[PipelineLayer], image_tokens: int, text_tokens: int,
                        per_sample: tuple[str, ...], text_weights: tuple[str, ...]) -> list[float]:
    """Forward FLOPs of one sample in each pipeline layer. The first layer is the embedder: its
    weights named in `text_weights` see the text tokens, the others the image's. A refiner (a
    layer with a `stream`, "image" or "caption") sees its stream's tokens; the blocks and the
    head see both. Weights named in `per_sample` (the timestep embedder, the modulations) see
    one token per sample. Token counts are as the layers get them (padding included)."""
    joint = image_tokens + text_tokens
    flops = []
    for index, layer in enumerate(layers):
        seq = {"image": image_tokens, "caption": text_tokens}.get(getattr(layer, "stream", None),
                                                                  joint)
        total = 0.0
        for name, param in layer.named_parameters():
            if not name.endswith("weight") or param.dim() != 2 or is_adapter_param(name):
                continue  # norms, biases, pad tokens, adapters
            if any(part in name for part in per_sample):
                tokens = 1
            elif index == 0:
                tokens = text_tokens if any(part in name for part in text_weights) else image_tokens
            else:
                tokens = seq
            total += 2 * param.numel() * tokens
            if ".to_q." in f".{name}":  # the query projection: one attention over the stream
                total += 4 * seq * seq * param.shape[0]
        flops.append(total)
    return flops
