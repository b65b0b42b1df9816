"""Gradient-norm clipping across pipeline stages, with the norm kept for logging.

DeepSpeed's own fp32 path clips but discards the norm. Each stage holds different parameters, so
the global norm sums squares over the pipeline group (data-parallel replicas already hold the
same averaged gradients). Kept as a tensor: no host sync in the step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def install_clipping(optimizer: torch.optim.Optimizer, max_norm: float, pipe_group) -> None:
    def clip(opt, _args, _kwargs):
        grads = [p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        sq = torch.zeros((), device=device, dtype=torch.float32)
        for g in grads:
            sq += g.detach().float().pow(2).sum()
        dist.all_reduce(sq, group=pipe_group)
        norm = sq.sqrt()
        if max_norm > 0:
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(scale.to(g.dtype))
        opt._global_grad_norm = norm  # DeepSpeed's engine reports this as the global grad norm

    optimizer.register_step_pre_hook(clip)
