"""Splitting an ordered list of layers into contiguous pipeline stages.

Pure functions over per-layer costs; the result is a list of `stages + 1` boundaries, stage i
owning layers [bounds[i], bounds[i+1]).
"""

from __future__ import annotations

from dpipe.config.schema import PartitionMethod
from dpipe.errors import ConfigError


def balanced_bounds(costs: list[float], stages: int) -> list[int]:
    """Contiguous split minimising the most expensive stage (exact dynamic programme)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][j]: the smallest possible max-stage cost of the first j layers in k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def stage_bounds(
    costs: list[float], stages: int, method: PartitionMethod, split: list[int] | None
) -> list[int]:
    n = len(costs)
    if stages > n:
        raise ConfigError(f"pipeline.stages={stages} but the model has only {n} pipeline layers")
    if method == PartitionMethod.uniform:
        return balanced_bounds([1.0] * n, stages)
    if method == PartitionMethod.balanced:
        return balanced_bounds(costs, stages)
    assert split is not None  # checked at config time
    if split[-1] >= n:
        raise ConfigError(f"pipeline.split={split}: layer indices must be < {n} (the layer count)")
    return [0, *split, n]
