"""Block swap: the frozen weights of some pipeline layers live on the host and are copied to the
device one layer ahead of their use, in forward and in backward.

What moves is every frozen tensor a layer holds: its parameters that do not require grad and its
buffers, whatever module type holds them (bf16 Linears, 8-bit `QuantizedLinear`s with their
scales, norms). Trainable parameters (LoRA adapters) stay on the device with their gradients and
optimizer state. A tensor held by more than one layer stays resident.

How a layer "has" its weights: each frozen tensor keeps its identity (the optimizer, autograd and
compiled graphs see the same objects) and only its storage changes, `t.data = ...`:
- parked: the host copy (pinned on CUDA). State dicts, checkpoints and exports read it as usual.
- loaded: a device copy made on a side CUDA stream; the compute stream waits for it before the
  layer runs, and the copy is freed once the layer has run (forward) or its backward has run.
Autograd keeps a frozen weight that a layer saves for backward as the tensor itself, so backward
reads whatever storage the tensor has then: the layer's backward, and its recompute under
activation checkpointing (which runs inside that backward), find it loaded again because a hook
on the layer's outputs loads it as soon as their gradient arrives, and starts the copy of the
next layer that backward will reach (the previous one in forward order).

The copies happen outside the layer call, in the stage's own loop (`before`/`after`) and in
autograd hooks, never in a compiled region: a compiled layer sees tensors of the same shape,
dtype and device on every call and does not recompile.

On the CPU host and device are the same memory: the swap then copies between two host tensors.
It saves nothing there, but runs the same bookkeeping, which is what the CPU tests check.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable, Sequence

import torch
from torch import nn

log = logging.getLogger("dpipe")


def frozen_tensors(layer: nn.Module) -> list[torch.Tensor]:
    """The tensors a layer holds that nothing trains: frozen parameters and buffers."""
    params = [p for p in layer.parameters() if not p.requires_grad]
    return params + [b for b in layer.buffers() if b is not None]


def frozen_bytes(layer: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in frozen_tensors(layer))


def swappable(layers: Sequence[nn.Module]) -> dict[int, list[torch.Tensor]]:
    """Each layer's frozen tensors that are its own (a tensor shared between layers stays
    resident), for the layers that hold any."""
    owners: dict[int, int] = {}
    for layer in layers:
        for t in {id(t): t for t in frozen_tensors(layer)}.values():
            owners[id(t)] = owners.get(id(t), 0) + 1
    out = {}
    for i, layer in enumerate(layers):
        own = list({id(t): t for t in frozen_tensors(layer) if owners[id(t)] == 1}.values())
        if own and any(t.numel() for t in own):
            out[i] = own
    return out


def first_swappable(layers: Sequence[nn.Module], count: int) -> list[int]:
    """`pipeline.blocks_to_swap=N`: the first N local layers that hold frozen weights."""
    return sorted(swappable(layers))[:count]


class BlockSwap:
    """The swapped layers of one pipeline stage. The stage's forward calls `before(i)` and
    `after(i, outputs)` around layer i, and `end_pass()` after each forward and backward pass.

    Built before the engine moves the module to the device (`deepspeed.initialize`): the
    swapped tensors are parked as empty placeholders then, so that they never reach the device
    all at once; `attach(device)` parks them on their host copies."""

    def __init__(self, layers: Sequence[nn.Module], swapped: Iterable[int],
                 poisoned: bool = False):
        # poisoned (tests): a parked tensor holds NaN (zeros if not float) instead of the host
        # copy, so that any use of a layer's weights outside `load`/`release` shows.
        self.poisoned = poisoned
        own = swappable(layers)
        self.order = sorted(i for i in swapped if i in own)
        self.tensors = {i: own[i] for i in self.order}
        # Host copies, taken from wherever the weights are now (the CPU, where dpipe loads).
        self.host = {i: [t.detach().to("cpu", copy=True) for t in ts]
                     for i, ts in self.tensors.items()}
        # Where each swapped buffer is registered. Moving a module (`module.to(device)` in
        # `deepspeed.initialize`) keeps a parameter's identity (it sets `.data`) but registers a
        # new tensor for each buffer: `attach` puts ours back, or the layer would read the
        # empty placeholder (seen on an H100: an fp8 scale of shape (0,) under a compiled layer).
        swapped_ids = {id(t) for ts in self.tensors.values() for t in ts}
        self.buffer_slots = [(module, name, buf) for i in self.order
                             for module in layers[i].modules()
                             for name, buf in module._buffers.items()
                             if buf is not None and id(buf) in swapped_ids]
        for ts in self.tensors.values():
            for t in ts:
                t.data = torch.empty(0, dtype=t.dtype)
        self.device = torch.device("cpu")
        self.stream = None
        self.loaded: dict[int, list[torch.Tensor]] = {}
        self.ready: dict[int, object] = {}  # index -> CUDA event its copy records
        self.events: list[tuple[str, int]] | None = None  # (action, layer) when a test records
        self.bandwidth: float | None = None  # host->device bytes/s, measured by `attach`

    @property
    def bytes(self) -> dict[int, int]:
        return {i: sum(t.numel() * t.element_size() for t in ts) for i, ts in self.host.items()}

    def attach(self, device: torch.device) -> None:
        """Parks the swapped tensors on their host copies (pinned on CUDA) for `device`."""
        self.device = device
        for module, name, buf in self.buffer_slots:
            module._buffers[name] = buf
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device)
            self.host = {i: [h.pin_memory() for h in hs] for i, hs in self.host.items()}
        for i in self.order:
            self._park(i)
        if device.type == "cuda" and self.order:
            self.bandwidth = self._measure_bandwidth()

    def _park(self, i: int) -> None:
        for t, h in zip(self.tensors[i], self.host[i]):
            t.data = (torch.full_like(h, float("nan") if h.is_floating_point() else 0)
                      if self.poisoned else h)

    def _record(self, action: str, i: int) -> None:
        if self.events is not None:
            self.events.append((action, i))

    def _measure_bandwidth(self) -> float:
        """Host->device bytes per second: one copy of the largest swapped layer, timed."""
        i = max(self.bytes, key=self.bytes.get)
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        copies = [h.to(self.device, non_blocking=True) for h in self.host[i]]
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        del copies
        return self.bytes[i] / max(seconds, 1e-9)

    def prefetch(self, i: int) -> None:
        """Starts copying layer i's weights to the device (on the side stream on CUDA)."""
        if i in self.loaded or i not in self.tensors:
            return
        self._record("prefetch", i)
        if self.stream is None:  # CPU: a second host tensor stands for the device copy
            self.loaded[i] = [h.clone() for h in self.host[i]]
            return
        # No wait on the compute stream: the host copy never changes, and the allocator hands
        # the side stream only blocks whose compute-stream use has ended (`record_stream`).
        with torch.cuda.stream(self.stream):
            self.loaded[i] = [h.to(self.device, non_blocking=True) for h in self.host[i]]
            event = torch.cuda.Event()
            event.record(self.stream)
        self.ready[i] = event

    def load(self, i: int) -> None:
        """Layer i's weights on the device now (waiting for its prefetch, or copying them)."""
        if i not in self.tensors:
            return
        self.prefetch(i)
        event = self.ready.pop(i, None)
        if event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)
            for d in self.loaded[i]:
                # Allocated on the side stream: freed only after the compute stream's use.
                d.record_stream(compute)
        self._record("load", i)
        for t, d in zip(self.tensors[i], self.loaded[i]):
            t.data = d

    def release(self, i: int) -> None:
        if i not in self.loaded:
            return
        self._record("release", i)
        # Prefetched and never used: only the side stream touched it, and the allocator
        # reuses it on that stream alone, after the copy.
        self.ready.pop(i, None)
        self._park(i)
        del self.loaded[i]

    def unswap(self, indices: Iterable[int]) -> None:
        """Layers whose weights stay on the device from now on (the memory plan's choice)."""
        for i in sorted(set(indices) & set(self.tensors)):
            self.release(i)
            for t, h in zip(self.tensors[i], self.host[i]):
                t.data = h.to(self.device, copy=True)
            self.order.remove(i)
            del self.tensors[i], self.host[i]

    def end_pass(self) -> None:
        """After a forward or backward pass: nothing stays loaded between passes."""
        for i in list(self.loaded):
            self.release(i)

    def before(self, i: int) -> None:
        """Before layer i's forward: its weights in, the next layer's on their way."""
        if i in self.tensors:
            self.load(i)
        self.prefetch(i + 1)

    def after(self, i: int, outputs) -> None:
        """After layer i's forward: its weights out; where the outputs will get a gradient, a
        hook that runs when it arrives (every layer gets one, so that backward releases each
        swapped layer as soon as it has passed it)."""
        self.release(i)
        if not (self.order and torch.is_grad_enabled()):
            return
        tensors = outputs if isinstance(outputs, tuple) else (outputs,)
        graph = [t for t in tensors if torch.is_tensor(t) and t.grad_fn is not None]
        if graph:
            torch.autograd.graph.register_multi_grad_hook(
                graph, lambda grad, i=i: self._backward_reaches(i), mode="any")

    def _backward_reaches(self, i: int) -> None:
        """Backward is about to run layer i (its recompute included): the layers after it are
        done, it needs its weights, and the layer before it comes next."""
        for j in list(self.loaded):
            if j > i:
                self.release(j)
        if i in self.tensors:
            self.load(i)
        self.prefetch(i - 1)
