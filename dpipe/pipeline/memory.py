"""Memory-aware activation checkpointing: recompute only as many layers as the budget needs.

"auto" runs the first step with every layer checkpointed (safe), measuring on its first
micro-batch how much memory each layer's saved activations take. With the memory the step left
allocated (weights, gradients, optimizer states), it then keeps the activations of as many layers
as fit, for the micro-batches a 1F1B pipeline stage holds at once, and recomputes the rest.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("dpipe")
GiB = 1 << 30
WORKSPACE = 2 * GiB  # kernels' temporary buffers, fragmentation


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


def plan(probe: ActivationProbe, resident: int, budget: int, in_flight: int) -> set[int]:
    """The local layers to checkpoint so that the estimated peak stays within `budget` bytes."""
    sizes = probe.bytes
    largest = max(sizes.values(), default=0)
    # Checkpointing the layers with the most activations first saves the most per recompute.
    order = sorted(sizes, key=lambda i: sizes[i], reverse=True)
    kept = sum(sizes.values())
    checkpointed: set[int] = set()
    for index in order:
        if resident + WORKSPACE + largest + in_flight * kept <= budget:
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

    def after_first_step(self) -> None:
        grads = sum(p.numel() * p.element_size() for p in self.module.parameters()
                    if p.requires_grad and p.grad is None)
        resident = torch.cuda.memory_allocated() + grads
        self.module.checkpointed = plan(self.probe, resident, self.budget, self.in_flight)
        n, total = len(self.module.checkpointed), len(self.module.forward_funcs)
        kept = sum(b for i, b in self.probe.bytes.items() if i not in self.module.checkpointed)
        log.info(
            "stage %d activation checkpointing (auto, budget %.1f GiB): %d of %d layers recompute; "
            "resident %.1f GiB + %d micro-batches x %.1f GiB of kept activations",
            self.stage, self.budget / GiB, n, total, resident / GiB, self.in_flight, kept / GiB,
        )
