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

With `pipeline.blocks_to_swap=auto` the first step also swaps every layer that can be
(dpipe.pipeline.block_swap): the least memory the stage can run in. The plan then chooses, layer
by layer, between recomputing its activations and streaming its frozen weights from the host,
cheapest seconds per byte saved first (`plan_swap`), from the measured forward time of each
layer and the measured host->device bandwidth.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dpipe.errors import ConfigError

log = logging.getLogger("dpipe")
GiB = 1 << 30
# Host memory of a worker process besides the model: the CUDA context, torch's and the
# libraries' code, the loader's prefetched micro-batches.
PROCESS_HOST = 3 * GiB


def loading_bytes(layer_bytes: list[int], batch: int = 0) -> int:
    """Host bytes a worker holds while it reads its stage's weights (`dpipe.train.trainable`),
    from each of the stage's layers' bytes as it reads them (`read_layer_bytes`): all of them,
    and in transit the largest layer's once more (read in its stored dtype, then cast) or the
    `batch` of tensors read at once, with their converted copies, if that is more."""
    return sum(layer_bytes) + max(max(layer_bytes, default=0), batch)


def read_layer_bytes(frozen: int, quantizable: int, trainable: int,
                     value_bytes: float | None, base_bytes: int = 2) -> int:
    """A layer's bytes as a worker reads them: its `frozen` weights as training keeps them
    (`base_bytes` a value: 2 for a bf16 LoRA's base, 4 in fp32; an fp8 base is quantized after
    the stage is read so), but for the `quantizable` values of its frozen Linears,
    `value_bytes` each where a LoRA keeps a quantized file's Linears as the file stores them
    (None: none kept so); and its `trainable` bytes."""
    if value_bytes is None:
        return frozen + trainable
    return frozen - round(quantizable * (base_bytes - value_bytes)) + trainable


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
        self.seconds: dict[int, float] = {}  # the forward's time: what a recompute costs

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
        # Timed on a second call: the first one compiles a compiled layer.
        torch.cuda.synchronize()
        start = time.perf_counter()
        layer(x)
        torch.cuda.synchronize()
        self.seconds[index] = time.perf_counter() - start


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


@dataclass
class LayerCost:
    """What one local layer costs and saves, measured in the first step."""
    activations: int  # bytes its kept activations take per micro-batch
    forward_s: float  # its forward's time: the cost of a recompute
    frozen: int = 0  # bytes of frozen weights it could swap (0: nothing to swap)
    copy_s: float = 0.0  # their host->device copy at the measured bandwidth

    @property
    def swap_s(self) -> float:
        """Seconds per micro-batch a swap adds: its two copies (forward and backward), less the
        compute they overlap with (the layer before it in forward, about its forward time; the
        one after it in backward, about twice that)."""
        return max(0.0, self.copy_s - self.forward_s) + max(0.0, self.copy_s - 2 * self.forward_s)


@dataclass
class MemoryPlan:
    checkpointed: set[int] = field(default_factory=set)
    swapped: set[int] = field(default_factory=set)
    peak: int = 0  # the estimated peak, bytes
    minimum: int = 0  # the estimated peak with every layer recomputed and swapped
    fits: bool = True


def loaded_bytes(costs: dict[int, LayerCost], swapped: set[int]) -> int:
    """Frozen bytes on the device at once: the unswapped layers', and two swapped layers' (the
    one running and the one being copied in)."""
    resident = sum(c.frozen for i, c in costs.items() if i not in swapped)
    return resident + sum(sorted((costs[i].frozen for i in swapped), reverse=True)[:2])


def plan_swap(costs: dict[int, LayerCost], base: int, budget: int, in_flight: int,
              transient: int = 0) -> MemoryPlan:
    """The layers to recompute and the layers to swap, so that the estimated peak stays within
    `budget` bytes at the least added time.

    `base`: what stays on the device whatever the plan (trainable weights, gradients, optimizer
    state, frozen weights that cannot swap); `transient` as in `plan`. Each candidate (recompute
    layer i: saves its kept activations on every micro-batch in flight; swap layer i: saves its
    frozen bytes) is taken in the order of seconds added per byte saved until the peak fits."""
    headroom = max([transient] + [c.activations for c in costs.values()]) \
        + fragmentation_margin(budget)

    def peak(checkpointed: set[int], swapped: set[int]) -> int:
        kept = sum(c.activations for i, c in costs.items() if i not in checkpointed)
        return int(base + headroom + loaded_bytes(costs, swapped)
                   + in_flight * kept * KEPT_FACTOR)

    candidates = [("recompute", i, c.forward_s, in_flight * c.activations * KEPT_FACTOR)
                  for i, c in costs.items() if c.activations > 0]
    candidates += [("swap", i, c.swap_s, c.frozen) for i, c in costs.items() if c.frozen > 0]
    # Cheapest per byte first; at equal cost, the larger saving; then a fixed order.
    candidates.sort(key=lambda a: (a[2] / a[3], -a[3], a[0], a[1]))
    result = MemoryPlan()
    for kind, index, _, _ in candidates:
        if peak(result.checkpointed, result.swapped) <= budget:
            break
        (result.checkpointed if kind == "recompute" else result.swapped).add(index)
    # One or two swapped layers save nothing (both may be on the device at once): undo them.
    if len(result.swapped) <= 2:
        result.swapped = set()
    result.peak = peak(result.checkpointed, result.swapped)
    everything = set(costs)
    result.minimum = peak(everything, {i for i, c in costs.items() if c.frozen > 0})
    result.fits = result.peak <= budget
    return result


def budget_bytes(budget_gb: float | None) -> int:
    if budget_gb is not None:
        return int(budget_gb * GiB)
    return int(0.92 * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


class AutoCheckpointing:
    """Drives "auto" over the first step of a process: all layers recompute while measuring,
    then the plan takes over. With a block swap that the plan chooses (`module.swap`,
    `module.plans_swap`: `pipeline.blocks_to_swap=auto`), every swappable layer swaps in the
    first step too, and the plan says which keep their weights on the device."""

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
        swap = getattr(self.module, "swap", None)
        if swap is not None and getattr(self.module, "plans_swap", False):
            return self._plan_with_swap(swap, resident, transient)
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

    def _plan_with_swap(self, swap, resident: int, transient: int) -> None:
        frozen, bandwidth = swap.bytes, swap.bandwidth or float("inf")
        costs = {i: LayerCost(self.probe.bytes.get(i, 0), self.probe.seconds.get(i, 0.0),
                              frozen.get(i, 0), frozen.get(i, 0) / bandwidth)
                 for i in range(len(self.module.forward_funcs))}
        # The first step swapped every swappable layer: none of their bytes is in `resident`.
        chosen = plan_swap(costs, resident, self.budget, self.in_flight, transient)
        stages = [None] * dist.get_world_size()
        dist.all_gather_object(stages, (self.stage, chosen.fits, chosen.minimum))
        short = sorted({(s, m) for s, fits, m in stages if not fits})
        if short:
            raise ConfigError(
                f"pipeline.memory_budget_gb={self.budget / GiB:.1f} is below what the model "
                "reaches with every layer recomputed and swapped (measured in the first step): "
                + ", ".join(f"stage {s} needs about {m / GiB:.1f} GiB" for s, m in short)
                + "; raise the budget, use more pipeline.stages, or model.base_dtype=fp8")
        swap.unswap(set(frozen) - chosen.swapped)
        self.module.checkpointed = chosen.checkpointed
        swapped = sorted(chosen.swapped)
        log.info(
            "stage %d memory plan (auto, budget %.1f GiB): %d of %d layers recompute, %d swap "
            "(%.2f GiB of frozen weights at %.1f GB/s host->device; per layer and micro-batch "
            "a swap adds %.1f ms, a recompute %.1f ms); estimated peak %.1f GiB",
            self.stage, self.budget / GiB, len(chosen.checkpointed), len(costs), len(swapped),
            sum(frozen[i] for i in swapped) / GiB, bandwidth / 1e9,
            1e3 * _mean([costs[i].swap_s for i in frozen]),
            1e3 * _mean([c.forward_s for c in costs.values()]), chosen.peak / GiB)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
