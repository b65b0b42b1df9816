"""Which frames each training sample of a video family conditions on (`dataset.conditioning`).

A sample's mode is drawn from a stream seeded by (seed, step, slot), as its noise is: every stage
and every resumed run draws the same one, with no state to save. The probabilities default to the
checkpoint's own task (`ModelSpec.frame_modes`), and a mode the checkpoint cannot take is refused
before any file is read.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter

from dpipe.config.schema import DatasetConfig
from dpipe.data.discover import directories
from dpipe.errors import ConfigError
from dpipe.models.frame_modes import FRAME_MODES
from dpipe.models.spec import ModelSpec


def frame_probabilities(spec: ModelSpec, cfg: DatasetConfig) -> dict[str, float] | None:
    """Each mode's probability, in `FRAME_MODES` order; None where every sample conditions on
    nothing (text-to-image and text-to-video), so batches carry no modes."""
    taken = spec.frame_modes()
    given = {m: getattr(cfg.conditioning, m) for m in FRAME_MODES}
    if all(p is None for p in given.values()):
        chosen = {m: float(taken.get(m, 0.0)) for m in FRAME_MODES}
    else:
        chosen = {m: 0.0 if p is None else float(p) for m, p in given.items()}
        named = ", ".join(f"{m}={p}" for m, p in given.items() if p is not None)
        if not all(math.isfinite(p) and 0 <= p <= 1 for p in chosen.values()):
            raise ConfigError(f"dataset.conditioning ({named}): each probability must be in "
                              "[0, 1]")
        if abs(sum(chosen.values()) - 1) > 1e-6:
            raise ConfigError(f"dataset.conditioning ({named}) sums to {sum(chosen.values()):g}: "
                              "the probabilities of first, last, both and none must sum to 1")
        refused = [m for m, p in chosen.items() if p > 0 and m not in taken]
        if refused:
            raise ConfigError(
                f"dataset.conditioning.{refused[0]}={chosen[refused[0]]}: model.family="
                f"{spec.family} at {spec.path} takes the frame mode(s) {', '.join(taken)} "
                f"only; give dataset.conditioning those, or train a checkpoint that takes "
                f"{refused[0]}")
    _check_frame_dirs(chosen, cfg)
    return None if chosen["none"] == 1.0 else chosen


def check_micro_batches(spec: ModelSpec, probabilities: dict[str, float] | None,
                        sizes: list[int]) -> None:
    """Refuses modes of several `ModelSpec.frame_mode_groups` where a micro-batch holds more
    than one sample (`sizes`: the run's micro-batch sizes of clips)."""
    if probabilities is None or max(sizes, default=1) <= 1:
        return
    used = [g for g in spec.frame_mode_groups if any(probabilities.get(m, 0) > 0 for m in g)]
    if len(used) > 1:
        asked = ", ".join(f"{m}={p:g}" for m, p in probabilities.items() if p > 0)
        raise ConfigError(
            f"dataset.conditioning ({asked}) with micro-batches of {max(sizes)} clips: "
            f"model.family={spec.family} cannot put samples given {' or '.join(used[1])} and "
            f"samples given {' or '.join(used[0])} in one micro-batch; set "
            "pipeline.micro_batch_size=1 (and dataset.micro_batch_sizes of clips to 1), or give "
            "dataset.conditioning modes of one of those groups only")


def _check_frame_dirs(chosen: dict[str, float], cfg: DatasetConfig) -> None:
    """first_frame_dir / last_frame_dir only where some sample is given that frame."""
    for key, modes in (("first_frame_dir", ("first", "both")),
                       ("last_frame_dir", ("last", "both"))):
        named = [str(d.path) for d in directories(cfg) if getattr(d.settings, key)]
        if named and not any(chosen[m] > 0 for m in modes):
            asked = ", ".join(f"{m}={p:g}" for m, p in chosen.items() if p > 0)
            raise ConfigError(
                f"dataset {key} (set for {', '.join(named)}): no sample is given its "
                f"{key.split('_')[0]} frame ({asked}); set dataset.conditioning.{modes[0]} or "
                f".{modes[1]} above 0 on a checkpoint that takes it, or remove {key}")


def draw_mode(probabilities: dict[str, float], seed: int, step: int, slot: int) -> int:
    """The mode (its index in FRAME_MODES) of the sample at `slot` of `step`."""
    digest = hashlib.sha256(f"{seed}/{step}/{slot}/frames".encode()).digest()
    u = int.from_bytes(digest[:8], "little") / 2.0 ** 64
    total = 0.0
    last = 0
    for index, mode in enumerate(FRAME_MODES):
        p = probabilities[mode]
        if p > 0:
            total, last = total + p, index
            if u < total:
                return index
    return last  # u beyond a sum rounded below 1


def planned_counts(plan, probabilities: dict[str, float], seed: int, steps: int) -> Counter:
    """How many samples of steps [0, steps) take each mode, by name (the dataset report's)."""
    counts: Counter = Counter()
    for step in range(steps):
        for micro in range(plan.micro_batches):
            for dp_rank in range(plan.data_parallel):
                for slot in plan.micro_batch(step, micro, dp_rank).slots:
                    counts[FRAME_MODES[draw_mode(probabilities, seed, step, slot)]] += 1
    return counts
