"""`dpipe-bench --run "NAME: experiment=<preset> ..."` times the preset's own model: the bench's
FLUX default gives way to a preset's `override /model` (it won over it, and the Wan 14B and
Qwen-Image 20B presets were refused as "model family flux has no benchmark config of that size")."""

from __future__ import annotations

import re

import pytest

from dpipe.bench.worker import require_size
from dpipe.bench.overrides import bench_overrides
from dpipe.config.compose import compose_run
from dpipe.config.experiments import CONF_DIR, presets
from dpipe.models.registry import build_spec


def _preset_model(preset: str) -> str:
    text = (CONF_DIR / "experiment" / f"{preset}.yaml").read_text()
    return re.search(r"override /model: (\w+)", text).group(1)


@pytest.mark.parametrize("preset", presets())
def test_a_preset_is_benchmarked_on_its_own_model_at_its_sizes(preset):
    run = compose_run(bench_overrides([f"experiment={preset}", "train.precision=bf16"]))
    assert run.model.family == _preset_model(preset)
    spec = build_spec(run.model)
    sizes = spec.bench_sizes()
    assert sizes, f"{preset}: model family {spec.family} has no benchmark size"
    for size in sizes:
        require_size(spec, size)  # exits naming the sizes where it is not one


def test_the_default_model_is_flux_and_a_named_one_wins():
    assert compose_run(bench_overrides(["pipeline=single"])).model.family == "flux"
    assert compose_run(bench_overrides(["model=wan", "pipeline=single"])).model.family == "wan"


@pytest.mark.slow  # the plan's real-size meta build of FLUX.1-dev: 2-4 s
def test_a_preset_is_benchmarked_with_its_plan_for_the_capped_gpu():
    """`dpipe-bench --memory-cap-gb 16 --run "x: experiment=flux_lora_24gb"` on an 80 GiB GPU
    times the plan a 16 GB card gets (the keys dpipe-train sets there), not the 80 GiB one's."""
    from dpipe.cli.bench import bench_run
    from dpipe.plan.machine import parse

    run = bench_run(["experiment=flux_lora_24gb", "train.precision=bf16"], parse("1x80"), 16)
    p = run.pipeline
    assert (p.stages, p.data_parallel, p.memory_budget_gb, run.model.base_dtype.value,
            p.activation_checkpointing, p.blocks_to_swap) == (1, 1, 15, "fp8", "auto", "auto")
