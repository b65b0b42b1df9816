"""The default pipeline never asks for more GPUs than are visible; a chosen one is obeyed."""

from __future__ import annotations

import pytest

from dpipe.config.checks import validate
from dpipe.config.compose import compose_config
from dpipe.config.default_pipeline import default_stages, fit_default_pipeline, user_chose_pipeline
from dpipe.config.schema import RunConfig
from dpipe.errors import ConfigError
from dpipe.launch.local import world_size_for


@pytest.mark.parametrize("overrides, experiment, chosen", [
    ([], None, False),
    (["model=flux", "optim.lr=1e-4", "dataset.path=/data/pipeline"], None, False),
    (["pipeline=two_stage"], None, True),
    (["pipeline.stages=2"], None, True),
    (["pipeline.micro_batches=8"], None, True),
    ([], "hunyuan_video_lora_2x24gb", True),
])
def test_what_counts_as_a_chosen_pipeline(overrides, experiment, chosen):
    assert user_chose_pipeline(overrides, experiment) is chosen


def test_the_default_runs_one_stage_on_one_gpu_and_says_why():
    stages, why = default_stages(2, None, gpus=1, chosen=False)
    assert stages == 1
    assert why.startswith("pipeline: 1 stage on 1 visible GPU: the default pipeline "
                          "(pipeline=two_stage) has 2 stages")
    assert default_stages(2, None, gpus=0, chosen=False) == (2, None)  # CPU: the demo's 2 stages
    assert default_stages(2, None, gpus=2, chosen=False) == (2, None)
    assert default_stages(2, None, gpus=8, chosen=False) == (2, None)
    assert default_stages(2, None, gpus=1, chosen=True) == (2, None)  # obeyed, fails later


def fitted(gpus: int, *overrides: str) -> tuple[RunConfig, str | None]:
    """The run config as `dpipe-train` makes it on `gpus` visible GPUs, and what it logs."""
    cfg = compose_config(list(overrides))
    why = fit_default_pipeline(cfg, cfg.hydra, gpus)
    return validate(cfg), why


def test_the_composed_default_fits_one_gpu_and_a_chosen_pipeline_does_not():
    run, why = fitted(1)
    assert (run.pipeline.stages, run.pipeline.micro_batches) == (1, 4) and why
    assert world_size_for(run, 1) == 1
    run, why = fitted(0)  # the CPU demo
    assert run.pipeline.stages == 2 and why is None and world_size_for(run, 0) == 2
    for chosen in ("pipeline=two_stage", "pipeline.stages=2"):
        run, why = fitted(1, chosen)
        assert run.pipeline.stages == 2 and why is None
        with pytest.raises(ConfigError, match="pipeline.stages=2 needs at least 2 GPUs; found 1"):
            world_size_for(run, 1)
