"""What a run's samples must equal: the family's diffusers pipeline, run in this process on the
weights the run exported, with each sample's prompt, seed, size and step count."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from dpipe.models.registry import build_spec
from dpipe.sample.requests import sample_requests
from tests.integration.trained import run_config


def requests_of(run_dir: Path):
    run = run_config(run_dir)
    spec = build_spec(run.model)
    return run, spec, sample_requests(run.sample, spec, run.dataset)


def saved_latents(folder: Path, index: int) -> torch.Tensor:
    return load_file(folder / f"{index}.safetensors")["latents"]


def diffusers_latents(run_dir: Path, weights: Path | None, full: bool = False) -> list[torch.Tensor]:
    """Per sample request of the run: the final latents of the family's diffusers pipeline with
    the LoRA export in `weights` (a full fine-tune's export with `full`; the base model with
    None)."""
    run, spec, requests = requests_of(run_dir)
    if weights is None:
        denoiser = spec.load_denoiser(torch.float32)
    elif full:
        denoiser = spec.load_exported_full(weights)
    else:
        denoiser = spec.load_denoiser_with_lora(weights)
    sampling = spec.sampling()
    steps = run.sample.steps or sampling.default_steps
    guidance = sampling.default_guidance if run.sample.guidance is None else run.sample.guidance
    with torch.no_grad():
        return [sampling.diffusers_sample(denoiser, r, steps, guidance) for r in requests]
