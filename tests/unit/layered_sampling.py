"""A family's sampler run in this process through its pipeline layers (what each stage of a run
runs, here one after another), for comparing with its diffusers pipeline."""

from __future__ import annotations

import torch

from dpipe.sample.denoise import denoise
from dpipe.sample.link import StageLink


def sample_through_layers(spec, denoiser, request, steps: int, guidance: float, text: dict,
                          uncond: dict | None, control: torch.Tensor | None) -> torch.Tensor:
    """The final latents of `request`, denoised by `spec`'s sampler through its layers from the
    given cached text and control latents (as the run's cache would hold them)."""
    sampling = spec.sampling()
    layers = spec.pipeline_layers(denoiser)

    def run(x):
        for layer in layers:
            x = layer(x)
        return x

    cpu = torch.device("cpu")
    state = sampling.start(request, steps, guidance, text, uncond, control, cpu)
    link = StageLink.local(cpu)
    assert not denoise(sampling, [state], link, run, steps)[0], link.error
    return state.latents


def nudged(denoiser: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """The denoiser with every weight moved off its initial value, so that every block matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in denoiser.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return denoiser
