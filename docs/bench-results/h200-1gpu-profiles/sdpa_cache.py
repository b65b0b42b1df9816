"""Which SDPA kernel does a compiled function run when the process's kernel flags change between
compiles? cudnn_check.py's compiled cases all gave cuDNN's errors, whichever kernel the flags
named: a cache of torch.compile (FX graph or AOTAutograd) may not key on SDPA's flags, so a run
could get the kernel an earlier compile of the same graph chose. `python sdpa_cache.py A B ...`
compiles, per argument, under flash-only (`flash`) or cuDNN-first (`cudnn`) flags, runs forward
and backward under the profiler and prints the attention kernels that ran.

`--dpipe` sets the flags as a run does, with dpipe.pipeline.attention.use_sdpa_kernels (the
default choice for `flash`, `model.attention=cudnn` for `cudnn`), which also points
TORCHINDUCTOR_CACHE_DIR at that choice's own folder: one process per argument, sharing one
cache folder, should then run each choice's own kernel. `--shape B,T,H,D` (default FLUX.1-dev's
1,4608,24,128) sets the attention's batch, tokens, heads and head dim."""

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


def kernels_run(order: str, via_dpipe: bool = False,
                shape: tuple[int, ...] = (1, 4608, 24, 128)) -> list[str]:
    if via_dpipe:
        from dpipe.config.schema import AttentionKernel, ModelConfig
        from dpipe.pipeline.attention import use_sdpa_kernels
        use_sdpa_kernels(ModelConfig(
            attention=AttentionKernel.cudnn if order == "cudnn" else AttentionKernel.sdpa),
            compiles=True)
    else:
        torch.backends.cuda.enable_cudnn_sdp(order == "cudnn")
        torch._C._set_sdp_priority_order([int(b) for b in ORDERS[order]])
    torch._dynamo.reset()
    fn = torch.compile(attention)
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    fn(q, k, v).sum().backward()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(q, k, v).sum().backward()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()
             if re.search(r"flash|fmha|sdpa|cudnn|attention", e.name, re.I)}
    return sorted(n[:90] for n in names)


if __name__ == "__main__":
    args = sys.argv[1:]
    via_dpipe = "--dpipe" in args
    shape = (1, 4608, 24, 128)
    if "--shape" in args:
        shape = tuple(int(n) for n in args[args.index("--shape") + 1].split(","))
        del args[args.index("--shape"):args.index("--shape") + 2]
    for order in [a for a in args if a != "--dpipe"]:
        print(f"compiled under {order}-first flags{' (dpipe)' if via_dpipe else ''} at {shape} "
              f"ran: {kernels_run(order, via_dpipe, shape)} "
              f"(cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR')})", flush=True)
