"""Rebuilds a trained model from a run's DeepSpeed checkpoint through dpipe's own code path.

Tests compare it with what the exported files give when loaded by diffusers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

from dpipe.config.checks import validate
from dpipe.data.batches import noised_batch
from dpipe.models.registry import build_spec
from dpipe.train.checkpoint import newest_complete
from dpipe.train.lora import make_trainable


def run_config(run_dir: Path):
    return validate(OmegaConf.load(run_dir / "run.yaml"))


def trained_layers(run_dir: Path):
    """The pipeline layers with the newest checkpoint's weights loaded."""
    run = run_config(run_dir)
    spec = build_spec(run.model)
    denoiser = spec.load_denoiser(torch.float32)
    make_trainable(denoiser, run.model, spec.lora_targets())
    layers = spec.pipeline_layers(denoiser)
    _, ckpt = newest_complete(run_dir)
    for i, layer in enumerate(layers):
        state = torch.load(ckpt / f"layer_{i:02d}-model_states.pt", map_location="cpu")
        missing, unexpected = layer.load_state_dict(state, strict=False)
        assert not unexpected, unexpected
    return spec, layers


def fixed_inputs(spec, seed: int = 0, size: int = 8, text_tokens: int = 32):
    """One deterministic micro-batch of model inputs (latents 4 x size x size, as the tiny VAE)."""
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(2, 4, size, size, generator=gen)
    text = {"t5": torch.randn(2, text_tokens, 32, generator=gen),
            "pooled": torch.randn(2, 32, generator=gen)}
    from dpipe.config.schema import TimestepConfig

    batch = noised_batch(spec, latents, text, TimestepConfig(), seed, 0, range(2))
    return spec.make_inputs(batch)[0]


@torch.no_grad()
def run_layers(layers, inputs):
    x = inputs
    for layer in layers:
        x = layer(x)
    return x


@torch.no_grad()
def run_diffusers(transformer, inputs):
    packed, t, text, pooled, guidance, txt_ids, img_ids = inputs
    return transformer(
        hidden_states=packed, encoder_hidden_states=text, pooled_projections=pooled, timestep=t,
        img_ids=img_ids.float(), txt_ids=txt_ids.float(), guidance=guidance, return_dict=False,
    )[0]
