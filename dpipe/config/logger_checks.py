"""Checks on `train.loggers` and `train.wandb`, before any worker starts."""

from __future__ import annotations

import importlib.util

from dpipe.config.schema import LoggerName, RunConfig
from dpipe.errors import ConfigError


def check_loggers(run: RunConfig) -> None:
    t = run.train
    names = [LoggerName(n).value for n in t.loggers]
    if len(set(names)) != len(names):
        raise ConfigError(f"train.loggers lists a logger twice: {names}")
    if LoggerName.jsonl.value not in names:
        raise ConfigError("train.loggers must keep jsonl: metrics.jsonl is the run's record, "
                          "which resumes, sweep summaries and dpipe's checks read; add or drop "
                          f"the others (now {names})")
    if LoggerName.wandb.value not in names:
        return
    if LoggerName.tensorboard.value not in names:
        raise ConfigError("train.loggers=[..., wandb] needs tensorboard too: wandb mirrors "
                          "what the run writes to TensorBoard (its scalars and samples)")
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("train.loggers lists wandb, which is not installed: "
                          "pip install 'dpipe[wandb]' (or pip install wandb)")
    if t.wandb.mode not in (None, "online", "offline"):
        raise ConfigError(f"train.wandb.mode must be online, offline or null (WANDB_MODE, "
                          f"else online), got {t.wandb.mode!r}")
