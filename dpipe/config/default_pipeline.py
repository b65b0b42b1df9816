"""The default pipeline on the GPUs there are.

conf/config.yaml's default, `pipeline=two_stage`, shows the pipeline on a CPU (two processes)
and splits a model over two GPUs. On one GPU it would ask for a second: there the default runs
one stage, with the same micro-batches per step (the same training, as gradient accumulation),
and the log says so. A pipeline the user chose (`pipeline=...`, `pipeline.<key>=...` on the
command line, or an experiment preset) is taken as it is, and fails if the GPUs are too few.
"""

from __future__ import annotations

from typing import Sequence

from omegaconf import DictConfig, read_write


def user_chose_pipeline(task_overrides: Sequence[str], experiment: str | None) -> bool:
    keys = [o.split("=", 1)[0].lstrip("~+") for o in task_overrides]
    return experiment is not None or any(k == "pipeline" or k.startswith("pipeline.") for k in keys)


def default_stages(stages: int, data_parallel: int | None, gpus: int, chosen: bool
                   ) -> tuple[int, str | None]:
    """The stages to run and why, when they differ from `stages` (else None): as many as the
    `gpus` visible hold, for a default pipeline that needs more. No GPU (CPU processes): as set."""
    if chosen or gpus == 0 or stages * (data_parallel or 1) <= gpus:
        return stages, None
    fitted = max(1, gpus // (data_parallel or 1))
    return fitted, (
        f"pipeline: {fitted} stage{'s' if fitted > 1 else ''} on {gpus} visible "
        f"GPU{'s' if gpus > 1 else ''}: the default pipeline (pipeline=two_stage) has {stages} "
        f"stages, one per GPU; pipeline=... or pipeline.stages=N chooses another "
        "(e.g. pipeline=single, pipeline=data_parallel)")


def fit_default_pipeline(cfg: DictConfig, hydra_cfg: DictConfig, gpus: int) -> str | None:
    """Sets `cfg`'s pipeline.stages to `default_stages`; returns the line to log, or None."""
    chosen = user_chose_pipeline(list(hydra_cfg.overrides.task),
                                 hydra_cfg.runtime.choices.get("experiment"))
    stages, why = default_stages(cfg.pipeline.stages, cfg.pipeline.data_parallel, gpus, chosen)
    if why is not None:
        with read_write(cfg):
            cfg.pipeline.stages = stages
    return why
