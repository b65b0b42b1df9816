"""DeepSpeed's pipeline engine with two costs of its per-micro-batch work removed.

1. **One backward pass per micro-batch.** A stage that sends several tensors downstream (image
   and text streams, the conditioning embedding) gets a gradient for each. DeepSpeed calls
   `out.backward(grad, retain_graph=True)` once per tensor, which walks every layer of the stage
   once per tensor. FLUX's double blocks mix both streams, so a first stage ran its backward about
   twice (2.34 s against 0.49 s of forward per 8-image step on an H200). One
   `torch.autograd.backward` over all the outputs computes the same sums in one walk.
2. **No host sync per micro-batch for tensor shapes.** Buckets change shapes between micro-batches,
   so each transfer is preceded by its shapes (`dynamic_shape`). DeepSpeed sends them as a GPU
   tensor, which costs a blocking host-to-device copy on the sender and an `.item()` per number on
   the receiver: the host waits for the GPU twice per micro-batch and the GPU then waits for the
   host to queue the next kernels. Here the shapes travel between the hosts over gloo, and the GPU
   queue is never drained for them.

3. **Receive buffers of the dtype asked for.** DeepSpeed keeps one receive buffer per position
   and hands back a view of it whatever dtype is asked, so a middle stage (3 stages or more),
   which receives activations and gradients into the same buffers, got an integer tensor's
   activation in a float buffer or the reverse. Here a buffer is kept per position and dtype.

`deepspeed.initialize` builds its own `PipelineEngine` and has no hook for a subclass, so
`adopt` re-classes the engine it returns (this class adds methods and two fields: the host group
and the receive buffers).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

# Integers per shape message: kind, count, then dtype, ndim and the sizes of each tensor.
META_SIZE = 256
SINGLE, TUPLE = 0, 2  # DeepSpeed's kinds: one tensor, a tuple of tensors


class StageEngine(PipelineEngine):
    _host_group = None  # gloo group of all ranks, set by `adopt` when there are several stages
    _typed_buffers: dict  # (position, dtype) -> receive buffer, set by `adopt`

    def _exec_backward_pass(self, buffer_id):
        try:
            self._backward_pass(buffer_id)
        finally:
            swap = getattr(self.module, "swap", None)
            if swap is not None:  # dpipe.pipeline.block_swap: nothing stays loaded
                swap.end_pass()

    def _backward_pass(self, buffer_id):
        if self.is_last_stage() or self.is_pipe_partitioned:
            # The loss's backward is DeepSpeed's own; partitioned outputs (tensor parallelism)
            # are not used by dpipe and keep DeepSpeed's path.
            return PipelineEngine._exec_backward_pass(self, buffer_id)
        outputs = self.pipe_buffers["outputs"][buffer_id]
        tensors = ([t for t in outputs if t.is_floating_point()] if isinstance(outputs, tuple)
                   else [outputs])
        grads = ([self.grad_layer] if isinstance(self.grad_layer, torch.Tensor)
                 else list(self.grad_layer))
        assert len(tensors) == len(grads), "stage outputs and received gradients differ in number"
        if self.using_bf16_optimizer:
            self.optimizer.clear_lp_grads()  # DeepSpeed's bf16 optimizer expects this per pass
        self._running_engine_backward = True  # DeepSpeed's hooks check it
        try:
            torch.autograd.backward(tensors, grad_tensors=grads)
        finally:
            self._running_engine_backward = False
        if self.using_bf16_optimizer and not self._config.bfloat16_config.immediate_grad_update:
            self.optimizer.update_hp_grads(clear_lp_grads=False)
        self.pipe_buffers["output_tensors"][buffer_id] = None
        self.pipe_buffers["outputs"][buffer_id] = None

    _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP,
                        schedule.BackwardPass: _exec_backward_pass}

    def _allocate_or_extend_buffers(self, idx, shape, dtype):
        numel = math.prod(shape)
        buffer = self._typed_buffers.get((idx, dtype))
        if buffer is None or buffer.numel() < numel:
            buffer = self._typed_buffers[(idx, dtype)] = torch.zeros(max(numel, 1), dtype=dtype,
                                                         device=self.device)
        return buffer[:numel].view(shape)

    def _send_tensor_meta(self, buffer, recv_stage):
        tensors = (buffer,) if isinstance(buffer, torch.Tensor) else buffer
        meta = [SINGLE if isinstance(buffer, torch.Tensor) else TUPLE, len(tensors)]
        for t in tensors:
            meta += [self.DTYPE_TO_ID[t.dtype], t.dim(), *t.shape]
        if len(meta) > META_SIZE:
            raise RuntimeError(f"a pipeline stage sends {len(tensors)} tensors whose shapes take "
                               f"{len(meta)} numbers; the shape message holds {META_SIZE}")
        message = torch.zeros(META_SIZE, dtype=torch.int64)
        message[:len(meta)] = torch.tensor(meta, dtype=torch.int64)
        dist.send(message, self.grid.stage_to_global(recv_stage), group=self._host_group)

    def _recv_tensor_meta(self, send_stage):
        message = torch.empty(META_SIZE, dtype=torch.int64)
        dist.recv(message, self.grid.stage_to_global(send_stage), group=self._host_group)
        meta = message.tolist()
        kind, count, offset = meta[0], meta[1], 2
        buffers = []
        for index in range(count):
            dtype, ndim = self.ID_TO_DTYPE[meta[offset]], meta[offset + 1]
            shape = meta[offset + 2:offset + 2 + ndim]
            offset += 2 + ndim
            buffers.append(self._allocate_or_extend_buffers(index, shape, dtype))
        return buffers[0] if kind == SINGLE else tuple(buffers)


def adopt(engine: PipelineEngine, stages: int) -> StageEngine:
    """Makes DeepSpeed's engine a StageEngine. Collective: every rank calls it."""
    if stages > 1:
        engine._host_group = dist.new_group(backend="gloo")
    engine._typed_buffers = {}
    engine.__class__ = StageEngine
    return engine
