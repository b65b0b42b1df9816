"""Which samples make up each micro-batch of each step: a pure function of the step.

Every stage and data-parallel rank computes the same plan, so the first and last pipeline stages
read the same samples, and a resumed run continues the exact order with no loader state to save.

An epoch: each bucket's samples (repeats counted) are shuffled with a seed of (seed, epoch,
bucket) and cut into *batches* of micro_batch_size x data_parallel samples, one micro-batch per
data-parallel rank, so every micro-batch of every rank stays inside one bucket. The batches of all
buckets are then shuffled together, and every `micro_batches` of them make a step. Samples that do
not fill a batch, and batches that do not fill a step, change from epoch to epoch; the dataset
report lists them.

The run's history (`<run_dir>/data/history.json`) records which manifest each stretch of steps
used. A run resumed after its files changed finishes the interrupted epoch with the manifest it
began with, so the order is exactly that of the uninterrupted run, and the changes apply from the
next epoch.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from dpipe.data.manifest import Bucket, Manifest, Sample, describe_changes
from dpipe.errors import DataError
from dpipe.io import atomic_write_text

HISTORY = "history.json"


@dataclass(frozen=True)
class Segment:
    """From `start_step` on (until the next segment), epochs count from `start_epoch` and use
    `manifest` with this layout."""

    start_step: int
    start_epoch: int
    manifest: str  # digest
    micro_batches: int
    data_parallel: int
    seed: int


@dataclass(frozen=True)
class MicroBatch:
    bucket: Bucket
    samples: list[Sample]
    slots: range  # positions in the step's global batch: they seed each sample's noise
    empty_text: str | None  # the empty caption's key (caption dropout)


def steps_per_epoch(manifest: Manifest, micro_batches: int, data_parallel: int) -> int:
    return batches_per_epoch(manifest, data_parallel) // micro_batches


def batches_per_epoch(manifest: Manifest, data_parallel: int) -> int:
    return sum(b.size // (b.micro_batch_size * data_parallel) for b in manifest.buckets)


class BatchPlan:
    def __init__(self, manifest: Manifest, micro_batch_size: int, micro_batches: int,
                 data_parallel: int, seed: int, history: dict | None = None,
                 saved: dict[str, Manifest] | None = None):
        self.manifest = manifest
        self.micro_batch_size = micro_batch_size  # the nominal size (buckets may differ)
        self.micro_batches = micro_batches
        self.data_parallel = data_parallel
        self.seed = seed
        self._manifests = {manifest.digest: manifest, **(saved or {})}
        self._history = [Segment(**s) for s in (history or {}).get("segments", [])]
        self.segments = [self._segment(0, 0)]
        self._groups: dict[tuple, list] = {}
        if self.steps_per_epoch == 0:
            raise DataError(
                f"no bucket fills one step: a step needs {micro_batches} batches "
                f"(pipeline.micro_batches), each of micro_batch_size x {data_parallel} "
                "data-parallel ranks samples from one bucket; see the dataset report above for "
                "each bucket's count, and add data, raise num_repeats, or lower "
                "pipeline.micro_batches / the micro-batch sizes")

    def _segment(self, start_step: int, start_epoch: int) -> Segment:
        return Segment(start_step, start_epoch, self.manifest.digest, self.micro_batches,
                       self.data_parallel, self.seed)

    # ---- sizes (of the current manifest) -----------------------------------------------------
    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.micro_batches * self.data_parallel

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.manifest, self.micro_batches, self.data_parallel)

    @property
    def left_over_per_epoch(self) -> int:
        """Samples per epoch that no step uses: those that do not fill a batch of their bucket,
        and the batches that do not fill a step (counted at their average size). Which ones
        changes from epoch to epoch."""
        dp = self.data_parallel
        total = sum(b.size for b in self.manifest.buckets)
        batches = batches_per_epoch(self.manifest, dp)
        in_batches = sum(b.size // (b.micro_batch_size * dp) * b.micro_batch_size * dp
                         for b in self.manifest.buckets)
        unused_batches = batches - self.steps_per_epoch * self.micro_batches
        return total - in_batches + round(unused_batches * in_batches / max(1, batches))

    # ---- the plan ----------------------------------------------------------------------------
    def locate(self, step: int) -> tuple[Segment, int, int]:
        """(segment, epoch, position of the step within its epoch)."""
        segment = [s for s in self.segments if s.start_step <= step][-1]
        spe = steps_per_epoch(self._manifests[segment.manifest], segment.micro_batches,
                              segment.data_parallel)
        epoch, position = divmod(step - segment.start_step, spe)
        return segment, segment.start_epoch + epoch, position

    def micro_batch(self, step: int, micro: int, dp_rank: int) -> MicroBatch:
        segment, epoch, position = self.locate(step)
        manifest = self._manifests[segment.manifest]
        cache_key = (segment.manifest, segment.data_parallel, segment.seed, epoch)
        groups = self._groups.get(cache_key)
        if groups is None:
            if len(self._groups) >= 2:
                self._groups.pop(next(iter(self._groups)))
            groups = self._groups[cache_key] = epoch_groups(manifest, segment.data_parallel,
                                                            segment.seed, epoch)
        bucket_index, members = groups[position * segment.micro_batches + micro]
        bucket = manifest.buckets[bucket_index]
        mbs = bucket.micro_batch_size
        width = max(b.micro_batch_size for b in manifest.buckets)
        start = (micro * segment.data_parallel + dp_rank) * width
        mine = members[dp_rank * mbs:(dp_rank + 1) * mbs]
        return MicroBatch(bucket, [bucket.samples[i] for i in mine], range(start, start + mbs),
                          manifest.empty_text)

    # ---- history and resume --------------------------------------------------------------------
    def resume(self, step: int, cached: Callable[[set[str]], bool] | None = None) -> str | None:
        """Sets the plan for a run (re)starting at `step` from the run's history; returns what
        changed since the history was written, in words, or None if nothing did. `cached(keys)`
        says whether the cache still holds those entries (asked only to replay an epoch)."""
        history = [s for s in self._history if s.start_step <= step]
        if not history:
            self.segments = [self._segment(0, 0)]
            return None
        if history[-1].manifest not in self._manifests:
            self.segments = history[:-1] + [self._segment(step, history[-1].start_epoch + 1)]
            return (f"the data plan saved at step {history[-1].start_step} is missing from the "
                    f"run dir; steps from {step} follow the current dataset")
        self.segments = history
        last, epoch, position = self.locate(step)
        old = self._manifests[last.manifest]
        same_layout = (last.micro_batches, last.data_parallel, last.seed) == (
            self.micro_batches, self.data_parallel, self.seed)
        if last.manifest == self.manifest.digest and same_layout:
            return None
        what = describe_changes(old, self.manifest)
        if not same_layout:
            what = (f"the batch layout changed (micro_batches {last.micro_batches} -> "
                    f"{self.micro_batches}, data_parallel {last.data_parallel} -> "
                    f"{self.data_parallel}, seed {last.seed} -> {self.seed})"
                    + ("" if what == "nothing" else f"; data: {what}"))
        if position == 0:  # at an epoch boundary: the new data starts now
            self.segments = [s for s in history if s.start_step < step] + [
                self._segment(step, epoch)]
            note = f"dataset changed since the last run: {what}. Epoch {epoch} uses the new data."
        elif same_layout and (cached is None or cached(old.keys())):
            # Mid-epoch: finish the epoch in its saved order, then use the new data.
            boundary = step + steps_per_epoch(old, last.micro_batches, last.data_parallel) \
                - position
            self.segments = history + [self._segment(boundary, epoch + 1)]
            note = (f"dataset changed since the last run: {what}. Epoch {epoch} continues in its "
                    f"saved order until step {boundary}; epoch {epoch + 1} then uses the new "
                    "data.")
        else:
            why = "the batch layout changed" if not same_layout else \
                "cache entries it needs were pruned"
            self.segments = history + [self._segment(step, epoch + 1)]
            note = (f"{what}. The rest of epoch {epoch} cannot be replayed ({why}): "
                    f"epoch {epoch + 1} starts now, at step {step}.")
        # An earlier resume may have planned exactly this already: nothing new to say then.
        return None if self.segments == self._history[:len(self.segments)] else note

    def save_history(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for digest in {s.manifest for s in self.segments}:
            self._manifests[digest].save(folder)
        payload = {"segments": [asdict(s) for s in self.segments]}
        atomic_write_text(folder / HISTORY, json.dumps(payload, indent=1) + "\n")


def load_history(folder: Path) -> tuple[dict | None, dict[str, Manifest]]:
    """The saved history and the manifests it names (those still readable)."""
    try:
        history = json.loads((folder / HISTORY).read_text())
    except (OSError, ValueError):
        return None, {}
    saved = {}
    for digest in {s["manifest"] for s in history.get("segments", [])}:
        manifest = Manifest.load(folder, digest)
        if manifest is not None and manifest.digest == digest:
            saved[digest] = manifest
    return history, saved


def _generator(*parts) -> torch.Generator:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def epoch_groups(manifest: Manifest, data_parallel: int, seed: int,
                 epoch: int) -> list[tuple[int, list[int]]]:
    """Every batch of the epoch, in order: (bucket index, sample indices of all DP ranks)."""
    groups: list[tuple[int, list[int]]] = []
    for number, bucket in enumerate(manifest.buckets):
        expanded = [i for i, s in enumerate(bucket.samples) for _ in range(s.repeats)]
        order = torch.randperm(len(expanded), generator=_generator(seed, epoch, bucket.name))
        size = bucket.micro_batch_size * data_parallel
        shuffled = [expanded[j] for j in order.tolist()]
        groups.extend((number, shuffled[g * size:(g + 1) * size])
                      for g in range(len(shuffled) // size))
    order = torch.randperm(len(groups), generator=_generator(seed, epoch, "batches"))
    return [groups[j] for j in order.tolist()]
