"""The run config: every option composes and validates; mistakes fail with the key named."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, MissingConfigException

from dpipe.config.checks import validate
from dpipe.config.store import register_schemas
from dpipe.errors import ConfigError
from tests.cli import dpipe_train

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ["model", "dataset", "optim", "pipeline", "train", "sample"]
# Options that need a user-given path to validate.
NEEDS = {("model", "flux"): ["model.path=/models/FLUX.1-dev"],
         ("model", "auraflow"): ["model.path=/models/AuraFlow-v0.3"],
         ("model", "sdxl"): ["model.path=/models/sd_xl_base_1.0.safetensors"],
         ("dataset", "folder"): ["dataset.path=/data/photos"]}


def _needs(group: str, option: str) -> list[str]:
    """Overrides a user must give for an option to validate (the weights of a real model)."""
    if (group, option) in NEEDS:
        return NEEDS[(group, option)]
    from omegaconf import OmegaConf

    cfg = _compose([f"{group}={option}"])
    return [f"{group}.path=/models/weights"] if OmegaConf.is_missing(cfg[group], "path") else []


def _compose(overrides):
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # `name` interpolates Hydra's runtime choices
    return cfg


def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_option_composes_and_validates(group, option):
    cfg = _compose([f"{group}={option}", *_needs(group, option)])
    run = validate(cfg, world_size=cfg.pipeline.stages)
    assert getattr(run, group) is not None


def test_overrides_reach_the_typed_config():
    run = validate(_compose(["model=flux", "model.path=/m", "pipeline=four_stage", "optim.lr=2e-5"]))
    assert run.model.family == "flux" and run.pipeline.stages == 4 and run.optim.lr == 2e-5


def test_misspelt_group_option_lists_the_choices():
    with pytest.raises(MissingConfigException, match="tiny_flux"):
        _compose(["model=fluxx"])


@pytest.mark.parametrize("override,key", [
    ("pipeline.stages=abc", "pipeline.stages"),
    ("optim.schedule=cosin", "optim.schedule"),
    ("train.precision=fp8", "train.precision"),
])
def test_wrong_type_or_value_names_the_key(override, key):
    with pytest.raises(ConfigCompositionException) as info:
        _compose([override])
    assert key in str(info.value.__cause__)


def test_unknown_key_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException, match="model.lora_rank"):
        _compose(["model.lora_rank=3"])


@pytest.mark.parametrize("override,named", [("+model.foo=1", "model.foo"), ("+bar=2", "bar")])
def test_plus_cannot_sneak_past_the_schema(override, named):
    with pytest.raises(ConfigError, match=f"'{named}'"):
        validate(_compose([override]))


@pytest.mark.parametrize("overrides,world,message", [
    (["pipeline.stages=3"], 4, "must divide the number of processes"),
    (["pipeline.zero_stage=2"], None, "ZeRO stage 0 or 1"),
    (["pipeline.partition=explicit"], None, "needs pipeline.split"),
    (["pipeline=four_stage", "pipeline.partition=explicit", "pipeline.split=[4,2,6]"], None, "increasing"),
    (["train.precision=bf16", "model.mode=full"], None, "zero_stage=1"),
    (["optim.lr=0"], None, "optim.lr"),
    (["pipeline.stages=2", "pipeline.data_parallel=2"], 2, "data_parallel"),
    (["model.attention=flex", "pipeline.compile=false"], None,
     "model.attention=flex needs compiled layers"),
])
def test_cross_field_checks(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        validate(_compose(overrides), world_size=world)


def test_few_micro_batches_are_advised_against():
    with pytest.warns(UserWarning, match="micro_batches"):
        validate(_compose(["pipeline.stages=4", "pipeline.micro_batches=2"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate(_compose(["pipeline.stages=2", "pipeline.micro_batches=4"]))


@pytest.mark.slow
def test_cli_prints_the_composed_job_config():
    done = dpipe_train("--cfg", "job", "model=flux", "pipeline.stages=4", "optim.lr=2e-5",
                       timeout=120)
    assert done.code == 0, done.err
    out = done.out
    assert "stages: 4" in out and "lr: 2.0e-05" in out and "family: flux" in out


@pytest.mark.slow
def test_cli_reports_a_config_error_without_traceback(tmp_path):
    proc = dpipe_train(f"hydra.run.dir={tmp_path}", "+model.foo=1", timeout=120)
    assert proc.code == 2
    assert "error: unknown config key(s): 'model.foo'" in proc.err
    assert "Traceback" not in proc.err


def test_layers_compile_by_default_on_a_gpu_only():
    """pipeline.compile=null (the default) compiles where CUDA is, not on the CPU; true and false
    choose anywhere."""
    import torch

    assert validate(_compose([])).pipeline.compile is None
    assert validate(_compose([])).pipeline.compiles == torch.cuda.is_available()
    assert validate(_compose(["pipeline.compile=true"])).pipeline.compiles
    assert not validate(_compose(["pipeline.compile=false"])).pipeline.compiles
