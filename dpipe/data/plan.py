"""Which dataset items make up each micro-batch of each step: a pure function of the step.

Every stage and data-parallel rank computes the same plan, so the first and last pipeline stages
read the same samples, and a resumed run continues the exact order with no loader state to save.
Each epoch is a fresh seeded permutation; the items left over after the last full batch of an
epoch differ from epoch to epoch, so none is left out for good.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from dpipe.errors import DataError


@dataclass(frozen=True)
class BatchPlan:
    num_items: int
    micro_batch_size: int
    micro_batches: int
    data_parallel: int
    seed: int

    def __post_init__(self):
        if self.steps_per_epoch == 0:
            raise DataError(
                f"the dataset has {self.num_items} items, fewer than one optimizer step needs "
                f"({self.global_batch} = micro_batch_size {self.micro_batch_size} x micro_batches "
                f"{self.micro_batches} x data_parallel {self.data_parallel}); add data, or lower "
                "pipeline.micro_batches / pipeline.micro_batch_size"
            )

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.micro_batches * self.data_parallel

    @property
    def steps_per_epoch(self) -> int:
        return self.num_items // self.global_batch

    @property
    def left_over_per_epoch(self) -> int:
        return self.num_items - self.steps_per_epoch * self.global_batch

    def slots(self, micro: int, dp_rank: int) -> range:
        """Positions within the step's global batch of one rank's micro-batch."""
        start = (micro * self.data_parallel + dp_rank) * self.micro_batch_size
        return range(start, start + self.micro_batch_size)

    def indices(self, step: int, micro: int, dp_rank: int) -> list[int]:
        epoch, position = divmod(step, self.steps_per_epoch)
        order = _permutation(self.num_items, self.seed, epoch)
        base = position * self.global_batch
        return [order[base + slot] for slot in self.slots(micro, dp_rank)]


@lru_cache(maxsize=4)
def _permutation(n: int, seed: int, epoch: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=gen).tolist()
