"""Which SDPA kernel does a compiled function run when the process's kernel flags change between
compiles? cudnn_check.py's compiled cases all gave cuDNN's errors, whichever kernel the flags
named: a cache of torch.compile (FX graph or AOTAutograd) may not key on SDPA's flags, so a run
could get the kernel an earlier compile of the same graph chose. `python sdpa_cache.py A B ...`
compiles, per argument, under flash-only (`flash`) or cuDNN-first (`cudnn`) flags, runs forward
and backward under the profiler and prints the attention kernels that ran.

`--dpipe` sets the flags as a run does, with dpipe.train.attention.use_sdpa_kernels (the
default choice for `flash`, `model.attention=cudnn` for `cudnn`), which also points
TORCHINDUCTOR_CACHE_DIR at that choice's own folder: one process per argument, sharing one
cache folder, should then run each choice's own kernel."""

from __future__ import annotations

import os
import re
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.profiler import ProfilerActivity, profile

ORDERS = {"flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
          "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]}


def attention(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                          v.transpose(1, 2)).transpose(1, 2)


def kernels_run(order: str, via_dpipe: bool = False) -> list[str]:
    if via_dpipe:
        from dpipe.config.schema import AttentionKernel
        from dpipe.train.attention import use_sdpa_kernels
        use_sdpa_kernels(AttentionKernel.cudnn if order == "cudnn" else AttentionKernel.sdpa)
    else:
        torch.backends.cuda.enable_cudnn_sdp(order == "cudnn")
        torch._C._set_sdp_priority_order([int(b) for b in ORDERS[order]])
    torch._dynamo.reset()
    fn = torch.compile(attention)
    q, k, v = (torch.randn(1, 4608, 24, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    fn(q, k, v).sum().backward()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(q, k, v).sum().backward()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()
             if re.search(r"flash|fmha|sdpa|cudnn|attention", e.name, re.I)}
    return sorted(n[:90] for n in names)


if __name__ == "__main__":
    via_dpipe = "--dpipe" in sys.argv
    for order in [a for a in sys.argv[1:] if a != "--dpipe"]:
        print(f"compiled under {order}-first flags{' (dpipe)' if via_dpipe else ''} ran: "
              f"{kernels_run(order, via_dpipe)} (cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR')})",
              flush=True)
