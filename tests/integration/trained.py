"""Rebuilds a trained model from a run's DeepSpeed checkpoint through dpipe's own code path.

Tests compare it with what the exported files give when loaded by diffusers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

from dpipe.config.checks import validate
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


def cached_dataset(run_dir: Path):
    """The run's dataset (from its cache) and batch plan, in this process, without DeepSpeed."""
    from dpipe.data.prepare import Layout, prepare

    run = run_config(run_dir)
    spec = build_spec(run.model)
    dataset = prepare(spec, run.dataset, torch.device("cpu"), torch.float32, Layout.of(run, 1))
    return dataset, dataset.plan


@torch.no_grad()
def run_layers(layers, inputs):
    x = inputs
    for layer in layers:
        x = layer(x)
    return x
