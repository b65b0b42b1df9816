"""Each step's micro-batches prepared ahead, in worker processes, while the engine trains.

What a step trains on is a pure function of the step (`step_micro_batches`: the plan, the cache
entries, and noise, timesteps and captions drawn from streams seeded by the step), so a worker
that computes step k ahead yields exactly what the main process would have at step k. The loader
of a resumed run simply starts at the resumed step; the number of workers never changes training.

With workers, the cache reads, the noise draws and the model's input packing leave the step's
critical path; on GPU the tensors arrive in pinned memory and are copied to the device without
waiting (DeepSpeed's own copy of a CPU tensor would block the host until the GPU drains).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from dpipe.errors import UserError

# make_step(step, records) -> the step's (inputs, labels) micro-batches; it appends each
# micro-batch's log record to `records` (a list) rather than writing it.
MakeStep = Callable[[int, list], Iterator[tuple[tuple, tuple]]]
# Steps each worker prepares ahead of the one training: enough to hide a slow cache read, few
# enough that the pinned host memory stays small (a 1024^2 FLUX micro-batch is ~10 MB).
PREFETCH = 2


class InMainProcess(Exception):
    """Raised by `make_step` in a worker for work that only the main process can do (re-making
    a damaged cache entry needs the encoders on this rank's device): the main process then
    makes that step itself."""


def default_workers(cuda: bool) -> int:
    """`train.loader_workers=null`: 2 worker processes on GPU; on CPU the step itself is CPU
    work, so workers would only compete with it for the same cores."""
    return 2 if cuda else 0


class _Steps(Dataset):
    """Item i: the micro-batches of step `first + i`, computed in a worker process."""

    def __init__(self, make_step: MakeStep, first: int, last: int):
        self.make_step, self.first, self.last = make_step, first, last

    def __len__(self) -> int:
        return max(0, self.last - self.first)

    def __getitem__(self, index: int):
        step = self.first + index
        records: list = []
        try:
            batches = list(self.make_step(step, records))
        except UserError as err:  # re-raised as it is by the main process, message intact
            return step, err, records
        except InMainProcess:
            return step, None, []
        return step, batches, records


def _as_is(item):
    return item


class StepLoader:
    """`next(step)`: the micro-batches of `step`, for `engine.train_batch(data_iter=...)`.

    Steps must be asked for in order from `first`. With `workers=0` each micro-batch is made when
    the engine asks for it, in this process (the plain path); otherwise `workers` processes
    (forked: nothing is pickled, and they never touch the GPU) prepare the coming steps.
    """

    def __init__(self, make_step: MakeStep, first: int, last: int, workers: int,
                 device: torch.device, write_record: Callable[[dict], None] | None = None):
        self.make_step, self.workers, self.device = make_step, workers, device
        self.write_record = write_record
        self._expected = first
        self._iter = None
        if workers > 0 and last > first:
            loader = DataLoader(
                _Steps(make_step, first, last), batch_size=None, shuffle=False,
                num_workers=workers, collate_fn=_as_is, pin_memory=device.type == "cuda",
                prefetch_factor=PREFETCH, multiprocessing_context="fork",
            )
            self._iter = iter(loader)

    def next(self, step: int) -> Iterator[tuple[tuple, tuple]]:
        if step != self._expected:
            raise RuntimeError(f"StepLoader: asked for step {step}, expected {self._expected}")
        self._expected += 1
        if self._iter is None:
            return self.make_step(step, None)
        got, batches, records = next(self._iter)
        if got != step:  # DataLoader keeps the order; this guards the resume arithmetic
            raise RuntimeError(f"StepLoader: a worker returned step {got} for step {step}")
        if isinstance(batches, BaseException):
            raise batches
        if batches is None:  # InMainProcess: the same step, made here
            batches = list(self.make_step(step, records))
        if self.write_record is not None:
            for record in records:
                self.write_record(record)
        # Pinned memory: the copies are queued behind the running kernels; the host goes on.
        return iter([(self._to_device(inputs), self._to_device(labels))
                     for inputs, labels in batches])

    def _to_device(self, tensors: tuple) -> tuple:
        if self.device.type != "cuda":
            return tensors
        return tuple(t.to(self.device, non_blocking=True) for t in tensors)

    def close(self) -> None:
        """Stops the workers (also done when the loader is garbage-collected)."""
        it, self._iter = self._iter, None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
