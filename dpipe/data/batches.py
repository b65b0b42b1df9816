"""Turns planned dataset items into the model's micro-batch tuples, with per-sample noise."""

from __future__ import annotations

from typing import Iterator

import torch

from dpipe.config.schema import TimestepConfig
from dpipe.data.plan import BatchPlan
from dpipe.diffusion.noise import sample_generator
from dpipe.diffusion.timesteps import sample_timesteps
from dpipe.models.spec import ModelSpec, NoisedBatch


def noised_batch(
    spec: ModelSpec, latents: torch.Tensor, text: dict[str, torch.Tensor],
    timesteps_cfg: TimestepConfig, seed: int, step: int, slots: range,
) -> NoisedBatch:
    noise, t = [], []
    for slot, x0 in zip(slots, latents):
        noise.append(torch.randn(x0.shape, generator=sample_generator(seed, step, slot, "noise")))
        t.append(sample_timesteps(timesteps_cfg, 1, sample_generator(seed, step, slot, "t")))
    noise_t = torch.stack(noise).to(latents.dtype)
    t_t = torch.cat(t)
    noisy, target = spec.noise(latents, noise_t, t_t)
    return NoisedBatch(latents=latents, noise=noise_t, timesteps=t_t, noisy=noisy, target=target,
                       text=text)


def step_micro_batches(
    spec: ModelSpec, dataset, plan: BatchPlan, timesteps_cfg: TimestepConfig,
    seed: int, step: int, dp_rank: int,
) -> Iterator[tuple[tuple, tuple]]:
    for micro in range(plan.micro_batches):
        latents, text = dataset.collate(plan.indices(step, micro, dp_rank))
        batch = noised_batch(spec, latents, text, timesteps_cfg, seed, step,
                             plan.slots(micro, dp_rank))
        yield spec.make_inputs(batch)
