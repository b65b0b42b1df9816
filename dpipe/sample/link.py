"""Forward-only passes through one pipeline's stages (one data-parallel replica), pipelined.

Each stage receives a micro-batch's tuple of tensors from the stage before it, runs its layers
and sends the result on, then takes the next micro-batch: while stage 1 runs micro-batch k,
stage 0 runs k+1. Tensor shapes travel first, over a gloo group between the hosts (so the GPU
queue is never drained for them); the tensors themselves over the default group (NCCL on GPUs).

A stage whose layers fail on a micro-batch (out of memory, say) sends a failure mark in place of
the tensors; later stages pass it on without running, so every rank stays in step and the caller
decides what to do with the failed sample. With one stage everything is local.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

META_SIZE = 256
FAILED = -1


class StageLink:
    def __init__(self, ranks: list[int], stage: int, device: torch.device,
                 pipe_group=None, host_group=None):
        self.ranks, self.stage, self.device = ranks, stage, device
        self.pipe_group, self.host_group = pipe_group, host_group
        self.stages = len(ranks)
        self.first, self.last = stage == 0, stage == self.stages - 1
        self.error: BaseException | None = None  # the first failure of this rank's layers

    @classmethod
    def local(cls, device: torch.device) -> "StageLink":
        return cls([0], 0, device)

    @classmethod
    def of_engine(cls, engine, host_group) -> "StageLink":
        """The link of the calling rank's pipeline in a DeepSpeed pipeline engine."""
        grid = engine.grid
        ranks = [grid.stage_to_global(s) for s in range(engine.num_stages)]
        return cls(ranks, engine.stage_id, engine.device, grid.get_pipe_parallel_group(),
                   host_group)

    def forward(self, run: Callable[[tuple], torch.Tensor], inputs: list[tuple] | None,
                count: int, keep: Callable[[tuple | torch.Tensor], torch.Tensor] | None = None
                ) -> list[torch.Tensor | None] | None:
        """Passes `count` micro-batches (`inputs` on the first stage; None for one that could not
        be made) through the stages; the last stage returns each one's output, None where it
        failed: `keep(output)` (default: the output, or its first tensor where the last layer
        returns several)."""
        outputs = []
        for k in range(count):
            if self.first:
                x = None if inputs[k] is None else tuple(self._to_device(t) for t in inputs[k])
            else:
                x = self._receive()
            y = None
            if x is not None:
                try:
                    y = run(x)
                except Exception as error:  # noqa: BLE001 - reported by the caller, who goes on
                    self.error = self.error or error
                    if isinstance(error, torch.cuda.OutOfMemoryError):
                        torch.cuda.empty_cache()
            if self.last:
                outputs.append(y if y is None else (keep or _first)(y))
            else:
                self._send(y)
        return outputs if self.last else None

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A copy from pageable host memory waits for the GPU's queue to drain (a host sync per
        micro-batch and step); from pinned memory it is queued like a kernel."""
        if self.device.type != "cuda" or t.device.type == "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def share(self, tensors: list[torch.Tensor]) -> None:
        """Gives every stage the last stage's values of `tensors` (in place)."""
        if self.stages == 1:
            return
        for t in tensors:
            dist.broadcast(t, src=self.ranks[-1], group=self.pipe_group)

    # ---- point to point ----------------------------------------------------------------------
    def _send(self, y) -> None:
        to = self.ranks[self.stage + 1]
        message = torch.zeros(META_SIZE, dtype=torch.int64)
        if y is None:
            message[0] = FAILED
            dist.send(message, to, group=self.host_group)
            return
        tensors = (y,) if isinstance(y, torch.Tensor) else tuple(y)
        meta = [len(tensors)]
        for t in tensors:
            meta += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
        message[:len(meta)] = torch.tensor(meta)
        dist.send(message, to, group=self.host_group)
        for t in tensors:
            dist.send(t.contiguous(), to)

    def _receive(self) -> tuple | None:
        source = self.ranks[self.stage - 1]
        message = torch.empty(META_SIZE, dtype=torch.int64)
        dist.recv(message, source, group=self.host_group)
        meta = message.tolist()
        if meta[0] == FAILED:
            return None
        tensors, offset = [], 1
        for _ in range(meta[0]):
            dtype, ndim = _DTYPES[meta[offset]], meta[offset + 1]
            shape = meta[offset + 2:offset + 2 + ndim]
            offset += 2 + ndim
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(t, source)
            tensors.append(t)
        return tuple(tensors)


def _first(y) -> torch.Tensor:
    return y if isinstance(y, torch.Tensor) else y[0]


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
           torch.bool, torch.uint8, torch.float8_e4m3fn]
