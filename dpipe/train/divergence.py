"""Stopping a run whose loss or gradient norm is no longer finite, before it checkpoints.

From a NaN or infinite gradient on, every step trains on NaN weights, and each checkpoint written
would hold them and push the good ones out of `train.keep_checkpoints`. So at each logged step
and before each checkpoint, every rank reads the step's loss and gradient norm and stops with an
error that names the newest checkpoint and what to change. The ranks agree without a collective:
DeepSpeed's pipeline engine averages the loss over the data-parallel replicas and broadcasts it
to every stage, and the gradient norm is global over the stages (dpipe.train.grad_clip, or
DeepSpeed's bf16 optimizer) and the replicas hold the same averaged gradients. The reads are host
syncs at those steps only, as the log's already were. (Training has no fp16 loss scaling, whose
skipped overflow steps would make a non-finite norm normal.)
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dpipe.config.schema import AttentionKernel, RunConfig
from dpipe.errors import TrainingDiverged
from dpipe.train import checkpoint
from dpipe.pipeline.attention import kernel_for


def not_finite(loss: float, grad_norm: float | None) -> str | None:
    """What is not finite in this step ("the loss is nan", "the gradient norm is inf"), or None."""
    found = [f"the {name} is {value}"
             for name, value in (("loss", loss), ("gradient norm", grad_norm))
             if value is not None and not math.isfinite(value)]
    return " and ".join(found) or None


def diverged(problem: str, step: int, run: RunConfig, run_dir: Path) -> TrainingDiverged:
    """The error that stops the run at `step`, before it writes that step's checkpoint."""
    newest = checkpoint.newest_complete(run_dir)
    kept = ("no checkpoint was written before it" if newest is None else
            f"the newest checkpoint, step {newest[0]} ({newest[1]}), was written before it and "
            "is kept: re-running in this run directory resumes from it (train.resume=false "
            "starts over)")
    tries = [f"a lower optim.lr (now {run.optim.lr:g})"]
    if not run.optim.grad_clip:
        tries.append("gradient clipping (optim.grad_clip=1.0; it is off)")
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if kernel_for(run.model.attention, capability, run.model.mode) == AttentionKernel.cudnn:
        tries.append("model.attention=sdpa (this run used cuDNN's attention kernel, whose "
                     "backward has trained to NaN before: docs/performance.md)")
    return TrainingDiverged(
        f"step {step}: {problem}, so training stopped without checkpointing this step; {kept}. "
        f"To try: {'; '.join(tries)}.")
