"""What a step makes the host do that stalls the GPU, counted while the step runs:

- host syncs: explicit device synchronizations (DeepSpeed's accelerator or torch.cuda) and, on
  CUDA, every operation that CUDA's sync debug mode flags (`.item()`, copies from pageable memory,
  ...). Each drains the GPU's queue: the GPU then idles while the host queues the next kernels.
  On the CPU, where nothing syncs, the operations that would sync on a GPU are counted instead
  (`GPU_SYNCING_OPS`: reading a value to the host, shapes that depend on values), so a CPU test
  finds them; copies between host and device show only on a GPU.
- backward passes: calls into autograd. One per micro-batch and stage is the minimum; more means
  layers ran their backward more than once.

`where` counts the source lines the syncs came from, so a report can name them.
`dpipe-bench` audits every timed step; training audits one (`train.audit_step`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dpipe.models.sync_free import on_host

SYNC_WARNING = "synchronizing CUDA operation"
_END = object()
_aten = torch.ops.aten
# Operations that wait for the GPU on CUDA whatever their arguments: a value read to the host,
# or an output whose shape depends on the values.
GPU_SYNCING_OPS = {
    _aten._local_scalar_dense.default,  # .item(), int(t), float(t), bool(t), `if t:`
    _aten.is_nonzero.default, _aten.equal.default,
    _aten.nonzero.default, _aten.masked_select.default,
    _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default,
}
# Boolean-mask indexing (`x[mask]`, `x[mask] = v`) runs nonzero on the mask.
_MASK_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
                  _aten._index_put_impl_.default}
_TORCH_DIR = str(Path(torch.__file__).parent)


def _is_mask_index(func, args) -> bool:
    if func not in _MASK_INDEXING:
        return False
    return any(i is not None and i.dtype == torch.bool for i in args[1])


def _repeat_interleave_without_size(func, kwargs) -> bool:
    # Its output size is the sum of the repeats unless given (output_size=).
    return func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None


def _caller() -> str:
    """The innermost frame outside torch and this module: the line of the model or trainer
    that asked."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


_OPTIM_DIR = str(Path(torch.optim.__file__).parent)


def _in_optimizer() -> bool:
    """torch's optimizers read their step counts, which stay on the host on a GPU too (unless
    fused or capturable), where reading them syncs nothing."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_OPTIM_DIR):
            return True
        frame = frame.f_back
    return False


class _WouldSyncOnGpu(TorchDispatchMode):
    def __init__(self, audit: "StepAudit"):
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if ((func in GPU_SYNCING_OPS or _is_mask_index(func, args)
                or _repeat_interleave_without_size(func, kwargs)) and not _in_optimizer()):
            self.audit.flagged_syncs += 1
            self.audit.where[f"{func.name()} at {_caller()}"] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def _counting_on_cpu(audit: "StepAudit"):
    """The CPU count, with `F.one_hot` given its class count left out: it checks the indices'
    range on the CPU, while on CUDA it leaves that to a device assert (no sync). Patched as a
    function, not through a TorchFunctionMode, under which torch.autograd.backward calls itself
    again (counting each backward pass twice)."""
    one_hot = torch.nn.functional.one_hot

    def sync_free_one_hot(tensor, num_classes=-1):
        if num_classes < 0:
            return one_hot(tensor, num_classes)
        with on_host():
            return one_hot(tensor, num_classes)

    torch.nn.functional.one_hot = sync_free_one_hot
    try:
        with _WouldSyncOnGpu(audit):
            yield
    finally:
        torch.nn.functional.one_hot = one_hot


class StepAudit:
    def __init__(self):
        self.explicit_syncs = 0
        self.flagged_syncs = 0
        self.backward_passes = 0
        self.where: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def counting(self):
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        patched = [(torch.cuda, "synchronize"), (accelerator, "synchronize"),
                   (torch.autograd, "backward")]
        saved = [getattr(owner, name) for owner, name in patched]
        counters = ["explicit_syncs", "explicit_syncs", "backward_passes"]
        for (owner, name), original, counter in zip(patched, saved, counters):
            setattr(owner, name, self._counted(original, counter))
        cuda = torch.cuda.is_available()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with contextlib.nullcontext() if cuda else _counting_on_cpu(self):
                    yield self
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
                for (owner, name), original in zip(patched, saved):
                    setattr(owner, name, original)
        flagged = [w for w in caught if SYNC_WARNING in str(w.message)]
        self.flagged_syncs += len(flagged)
        self.where.update(f"{w.filename}:{w.lineno}" for w in flagged)
        for w in caught:  # the step's other warnings still reach the user
            if w not in flagged:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def _counted(self, fn, counter: str):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            setattr(self, counter, getattr(self, counter) + 1)
            if counter == "explicit_syncs":
                self.where[f"synchronize at {_caller()}"] += 1
            return fn(*args, **kwargs)

        return run

    def made_on_host(self, micro_batches):
        """The step's micro-batches, each made outside the CPU count: batches are made on the
        host by design (dpipe.data.batches), and only their finished tensors go to the GPU."""
        iterator = iter(micro_batches)
        while True:
            with on_host():
                item = next(iterator, _END)
            if item is _END:
                return
            yield item

    @property
    def host_syncs(self) -> int:
        return self.explicit_syncs + self.flagged_syncs

    def worst(self, count: int = 5) -> str:
        """The lines that synced most, for a report."""
        return "; ".join(f"{n}x {where}" for where, n in self.where.most_common(count))
