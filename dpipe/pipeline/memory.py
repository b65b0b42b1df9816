"""Memory-aware activation checkpointing: recompute only as many layers as the budget needs.

"auto" runs the first step with every layer checkpointed (safe), measuring on its first
micro-batch how much memory each layer's saved activations take, and how far above the resident
memory (weights, gradients, optimizer states) that step peaked: the layer inputs held for the
micro-batches in flight, a recomputed layer's activations and backward's temporary buffers. It
then keeps the activations of as many layers as fit on top of that, for the micro-batches a 1F1B
pipeline stage holds at once, and recomputes the rest.

A fixed allowance for the transient part is not enough: at a 24 GiB budget with fp8 FLUX.1-dev
weights, a 2 GiB one planned 21.3 GiB and backward then ran out at 23.1 GiB allocated + 0.9 GiB
lost to fragmentation (H200, 2026-12-01). The measured peak covers the first, the margin the second.
The probe also undercounts what a kept layer holds through backward under per-block compile: with
the measured peak in the plan (14.0 resident + 1.0 transient + 7.3 kept activations) that run
still reached 23.1 GiB allocated, so kept activations are planned at KEPT_FACTOR times the probe.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("dpipe")
GiB = 1 << 30


# Measured >= 1.11 (8.1 / 7.3 GiB) on FLUX.1-dev, compiled, before the OOM, when an eager
# checkpoint wrapped the compiled layers. Since compiled layers recompute inside their graph
# (dpipe.pipeline.recompute) the peaks on an H200 say at most ~1.07 for FLUX.1-dev (fp8, 24 GiB)
# and ~0.95 for Wan 2.1 14B (docs/performance.md); lowering it waits for a run that tests the
# edge.
KEPT_FACTOR = 1.3


def fragmentation_margin(budget: int) -> int:
    """Reserved-but-unusable allocator memory to leave free (0.9 GiB seen at a 24 GiB budget)."""
    return max(GiB, budget // 20)


class ActivationProbe:
    """Saved-activation bytes per local layer, measured by a forward with grad."""

    def __init__(self):
        self.bytes: dict[int, int] = {}

    def measure(self, index: int, layer, x) -> None:
        if not torch.is_grad_enabled():
            return
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = layer(x)
        outputs = out if isinstance(out, tuple) else (out,)
        out_bytes = sum(t.numel() * t.element_size() for t in outputs if torch.is_tensor(t))
        self.bytes[index] = max(0, torch.cuda.memory_allocated() - before - out_bytes)
        del out, outputs  # frees the graph: this forward was only a measurement


def in_flight_micro_batches(stage: int, stages: int, micro_batches: int) -> int:
    """Micro-batches whose activations a stage holds at once under DeepSpeed's 1F1B schedule."""
    return min(micro_batches, stages - stage)


def plan(probe: ActivationProbe, resident: int, budget: int, in_flight: int,
         transient: int = 0) -> set[int]:
    """The local layers to checkpoint so that the estimated peak stays within `budget` bytes.

    `transient`: how far the all-recompute first step peaked above `resident`; never less than
    one layer's activations (the one being recomputed)."""
    sizes = probe.bytes
    headroom = max(transient, max(sizes.values(), default=0)) + fragmentation_margin(budget)
    # Checkpointing the layers with the most activations first saves the most per recompute.
    order = sorted(sizes, key=lambda i: sizes[i], reverse=True)
    kept = sum(sizes.values())
    checkpointed: set[int] = set()
    for index in order:
        if resident + headroom + in_flight * kept * KEPT_FACTOR <= budget:
            break
        checkpointed.add(index)
        kept -= sizes[index]
    return checkpointed


def budget_bytes(budget_gb: float | None) -> int:
    if budget_gb is not None:
        return int(budget_gb * GiB)
    return int(0.92 * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


class AutoCheckpointing:
    """Drives "auto" over the first step of a process: all layers recompute while measuring,
    then the plan takes over."""

    def __init__(self, module, stage: int, stages: int, micro_batches: int, budget_gb):
        self.module, self.stage = module, stage
        self.in_flight = in_flight_micro_batches(stage, stages, micro_batches)
        self.budget = budget_bytes(budget_gb)
        self.probe = ActivationProbe()
        module.checkpointed = set(range(len(module.forward_funcs)))
        module.probe = self.probe
        torch.cuda.reset_peak_memory_stats()  # the peak of the first step, not of model loading

    def after_first_step(self) -> None:
        grads = sum(p.numel() * p.element_size() for p in self.module.parameters()
                    if p.requires_grad and p.grad is None)
        resident = torch.cuda.memory_allocated() + grads
        transient = max(0, torch.cuda.max_memory_allocated() - resident)
        self.module.checkpointed = plan(self.probe, resident, self.budget, self.in_flight,
                                        transient)
        n, total = len(self.module.checkpointed), len(self.module.forward_funcs)
        kept = sum(b for i, b in self.probe.bytes.items() if i not in self.module.checkpointed)
        log.info(
            "stage %d activation checkpointing (auto, budget %.1f GiB): %d of %d layers recompute; "
            "resident %.1f GiB + first-step transient %.1f GiB + %d micro-batches x %.1f GiB of kept "
            "activations", self.stage, self.budget / GiB, n, total, resident / GiB,
            transient / GiB, self.in_flight, kept / GiB,
        )
