"""GPU memory of the audited step (`train.audit_step`), per pipeline stage.

Each rank's peak allocation in that step is gathered with the audit's other counts; rank 0
records the highest as `perf/peak_memory_gib` and logs each stage's. A pipeline splits a model so
that it fits; where its stages together would fit on one GPU, data parallelism (every GPU a whole
replica, no bubble) trains faster: 1.99x on 2 H200s against 1.37x for 2 stages on a FLUX.1-dev
LoRA (docs/performance.md, target 3). Then the log says so.
"""

from __future__ import annotations


def stage_peaks(stages: list[int], peaks: list[float]) -> list[float]:
    """Each stage's highest peak over its data-parallel ranks, in stage order; `stages[i]` and
    `peaks[i]` are rank i's stage and peak."""
    out = [0.0] * (max(stages) + 1)
    for stage, peak in zip(stages, peaks):
        out[stage] = max(out[stage], peak)
    return out


def one_gpu_hint(peaks_gib: list[float], budget_gib: float) -> str | None:
    """The hint for a pipeline of several stages whose peaks add up to no more than one GPU's
    memory budget, else None. The sum overstates what one GPU would need: a first stage holds
    the activations of several micro-batches in flight, and one GPU only one at a time."""
    together = sum(peaks_gib)
    if len(peaks_gib) < 2 or together > budget_gib:
        return None
    return (f"the {len(peaks_gib)} pipeline stages together peaked at {together:.1f} GiB, within "
            f"one GPU's budget of {budget_gib:.1f} GiB: the model fits on one GPU, where data "
            "parallelism usually trains faster than a pipeline (no bubble, no stage imbalance); "
            "try pipeline=data_parallel (docs/performance.md, target 3)")
