"""What a step makes the host do that stalls the GPU, counted while the step runs:

- host syncs: explicit device synchronizations (DeepSpeed's accelerator or torch.cuda) and, on
  CUDA, every operation that CUDA's sync debug mode flags (`.item()`, copies from pageable memory,
  ...). Each drains the GPU's queue: the GPU then idles while the host queues the next kernels.
- backward passes: calls into autograd. One per micro-batch and stage is the minimum; more means
  layers ran their backward more than once.

`dpipe-bench` audits every timed step; training audits one (`train.audit_step`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

SYNC_WARNING = "synchronizing CUDA operation"


class StepAudit:
    def __init__(self):
        self.explicit_syncs = 0
        self.flagged_syncs = 0
        self.backward_passes = 0

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
                yield self
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
                for (owner, name), original in zip(patched, saved):
                    setattr(owner, name, original)
        flagged = [w for w in caught if SYNC_WARNING in str(w.message)]
        self.flagged_syncs += len(flagged)
        for w in caught:  # the step's other warnings still reach the user
            if w not in flagged:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def _counted(self, fn, counter: str):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            setattr(self, counter, getattr(self, counter) + 1)
            return fn(*args, **kwargs)

        return run

    @property
    def host_syncs(self) -> int:
        return self.explicit_syncs + self.flagged_syncs
