"""The denoising loop over a pipeline's stages: every request's micro-batches of a step go
through the stages together (the prompt and, with classifier-free guidance, the negative prompt
as two micro-batches), so the stages stay busy with as many requests as there are."""

from __future__ import annotations

from typing import Callable

import torch

from dpipe.models.sampling import Denoising, FamilySampling
from dpipe.sample.link import StageLink


def denoise(sampling: FamilySampling, states: list[Denoising], link: StageLink,
            run: Callable[[tuple], torch.Tensor], steps: int) -> list[bool]:
    """Denoises `states` in place on every stage (each ends with the final latents); returns,
    per state, whether it failed on some rank's part of the work (`link.error` says why)."""
    failed = [False] * len(states)
    with torch.no_grad():
        for i in range(steps):
            inputs = None
            if link.first:
                inputs = []
                for d in states:
                    texts = [d.text] if d.uncond is None else [d.text, d.uncond]
                    for text in texts:
                        try:
                            inputs.append(sampling.inputs(d, d.timesteps[i], text))
                        except Exception as error:  # noqa: BLE001 - this sample fails, not the run
                            link.error = link.error or error
                            inputs.append(None)  # the stages pass it on as failed
            count = sum(2 if d.uncond is not None else 1 for d in states)
            outputs = link.forward(run, inputs, count, keep=sampling.output)
            flags = torch.zeros(len(states), device=link.device)
            if link.last:
                at = 0
                for k, d in enumerate(states):
                    cond = outputs[at]
                    uncond = outputs[at + 1] if d.uncond is not None else None
                    at += 2 if d.uncond is not None else 1
                    if failed[k] or cond is None or (d.uncond is not None and uncond is None):
                        failed[k] = True
                        continue
                    try:
                        prediction = sampling.prediction(cond, d)
                        if uncond is not None:
                            prediction = sampling.guide(prediction, sampling.prediction(uncond, d), d)
                        sampling.step(d, d.timesteps[i], prediction)
                    except Exception as error:  # noqa: BLE001
                        link.error = link.error or error
                        failed[k] = True
                flags = torch.tensor([float(f) for f in failed], device=link.device)
            link.share([d.latents for d in states] + [flags])
            failed = [bool(f) for f in flags.tolist()]
    return failed
