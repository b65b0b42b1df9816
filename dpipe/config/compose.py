"""Composing a run config in-process (benchmarks, tools, tests), as `dpipe-train` would."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dpipe.config.checks import validate
from dpipe.config.experiments import preset_overrides
from dpipe.config.schema import RunConfig
from dpipe.config.store import register_schemas

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose_config(overrides: list[str]) -> DictConfig:
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=preset_overrides(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # `name` interpolates Hydra's runtime choices
    return cfg


def compose_run(overrides: list[str], world_size: int | None = None) -> RunConfig:
    return validate(compose_config(overrides), world_size=world_size)
