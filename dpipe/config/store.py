"""Registers the schemas in Hydra's ConfigStore.

Every option file `conf/<group>/<option>.yaml` starts with `defaults: [base_<group>, _self_]`, so
its keys are checked against the group's dataclass when Hydra composes the run.
"""

from hydra.core.config_store import ConfigStore

from dpipe.config.run_name import register_resolver as register_run_name
from dpipe.config.schema import (
    DatasetConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    RunConfig,
    SampleConfig,
    TrainConfig,
)

GROUP_SCHEMAS = {
    "model": ModelConfig,
    "dataset": DatasetConfig,
    "optim": OptimConfig,
    "pipeline": PipelineConfig,
    "train": TrainConfig,
    "sample": SampleConfig,
}


def register_schemas() -> None:
    register_run_name()  # conf/config.yaml's `name`
    cs = ConfigStore.instance()
    cs.store(name="base_run", node=RunConfig)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)
