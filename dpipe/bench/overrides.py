"""The overrides a benchmark composes its run config with (`dpipe-bench --run`,
`python -m dpipe.bench.layers`): random weights and data, FLUX unless the run chooses a model."""

from __future__ import annotations

DEFAULTS = ["model.path=/unused", "dataset=synthetic", "train.progress_bar=false"]


def bench_overrides(args: list[str], defaults: list[str] = DEFAULTS) -> list[str]:
    """`args` after the defaults, with `model=flux` first unless `args` name a model or a
    preset (`experiment=`) that chooses one: a `model=flux` before a preset would win over its
    `override /model`."""
    chooses_model = any(a.lstrip("+").startswith(("model=", "experiment=")) for a in args)
    return ([] if chooses_model else ["model=flux"]) + list(defaults) + list(args)
