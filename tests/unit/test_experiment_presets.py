"""The presets per GPU size, conf/experiment/*.yaml: each composes through dpipe's validation as
`experiment=<name>` and as `+experiment=<name>`, the command line wins over it, a name that is
not a preset is refused with the list of those that are, each is a thin delta (the model, its
resolution, the machine it is for: pipeline=auto plans the rest, tests/unit/test_plan.py checks
that plan on each preset's machine), and the tightest plan's budget is at least what the
model's weights need on the device (computed at real size on the meta device, no GPU).

What no CPU test checks: the activations, backward's temporary buffers and the allocator's
fragmentation that the first step measures on a GPU (dpipe.pipeline.memory). Whether a preset
trains within its card is known only from a GPU run; each preset's header says whether one was.
"""

from __future__ import annotations

import pytest
import torch

from dpipe.config.compose import CONF_DIR, compose_config, compose_run
from dpipe.cli.train_plan import PlanRequest, apply_auto_pipeline, plan_machine
from dpipe.config.experiments import preset_keys, preset_overrides, presets
from dpipe.plan.choose import PLANNED_KEYS
from dpipe.plan.machine import parse
from dpipe.errors import ConfigError

PRESETS = presets()
# Each preset's model at the dpipe-bench size that the preset is for (ModelSpec.bench_configs).
BENCH_SIZE = {"flux": "dev", "wan": "14b", "qwen_image": "20b", "hunyuan_video": "13b"}
GiB = 1 << 30


def _run(name: str, *overrides: str, plus: bool = False):
    # model.path: the presets name no weights (each user's own folder); world size: one process
    # per pipeline stage, as on the GPUs the preset is for.
    cfg = compose_config([f"{'+' if plus else ''}experiment={name}", "model.path=/models/x",
                          *overrides])
    return compose_run([f"experiment={name}", "model.path=/models/x", *overrides],
                       world_size=cfg.pipeline.stages)


def test_the_presets_are_there():
    assert {"flux_lora_16gb", "flux_lora_24gb", "wan14b_lora_24gb", "qwen_image_lora_24gb",
            "hunyuan_video_lora_2x24gb"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("plus", [False, True], ids=["experiment=", "+experiment="])
def test_every_preset_composes_and_validates(name, plus):
    run = _run(name, plus=plus)
    assert not run.model.tiny and run.model.family in BENCH_SIZE, \
        f"{name}: a preset is for a real model; add its bench size to BENCH_SIZE"
    # A thin delta: the machine it is for, and pipeline=auto plans every layout key for it.
    assert run.pipeline.auto and plan_machine(compose_config([f"experiment={name}"]), None)
    assert not preset_keys(name) & set(PLANNED_KEYS), f"{name}: leave these keys to the plan"
    header = (CONF_DIR / "experiment" / f"{name}.yaml").read_text().split("\ndefaults:")[0]
    assert header.startswith("# @package _global_") and "measured" in header.lower(), \
        f"{name}: the header says what card it is for and whether it was measured on a GPU"


@pytest.mark.parametrize("name", PRESETS)
def test_the_headers_command_validates(name):
    """The `dpipe-train ...` line of each preset's header, as a user would paste it."""
    import shlex

    lines = (CONF_DIR / "experiment" / f"{name}.yaml").read_text().splitlines()
    command, = [shlex.split(line.lstrip("# ")) for line in lines
                if line.lstrip("# ").startswith("dpipe-train ")]
    assert f"experiment={name}" in command
    compose_run(command[1:], world_size=_run(name).pipeline.stages)


@pytest.mark.parametrize("name", PRESETS)
def test_the_command_line_wins_over_the_preset(name):
    run = _run(name, "optim.lr=3e-5", "pipeline.memory_budget_gb=21.5", "dataset.resolutions=[512]")
    assert (run.optim.lr, run.pipeline.memory_budget_gb, run.dataset.resolutions) == \
        (3e-5, 21.5, [512])
    # A group chosen on the command line wins over the preset's `override /group:` too.
    assert compose_config([f"experiment={name}", "model=tiny_flux"]).model.family == "flux"
    assert compose_config([f"experiment={name}", "model=tiny_flux"]).model.tiny


def test_the_machine_planned_for():
    """--machine wins over the GPUs visible, which win over the machine a preset names; a
    pipeline.machine that is not one is refused naming the key."""
    cfg = compose_config(["experiment=flux_lora_16gb", "model.path=/models/x"])
    assert plan_machine(cfg, None) == parse("1x16,host=64")
    assert plan_machine(cfg, None, visible=parse("1x80")) == parse("1x80")
    assert plan_machine(cfg, PlanRequest(parse("2x24")), visible=parse("1x80")) == parse("2x24")
    assert plan_machine(compose_config([]), None) is None
    with pytest.raises(ConfigError, match="^pipeline.machine=24: give GPUs x GiB per GPU"):
        plan_machine(compose_config(["pipeline=auto", "pipeline.machine=24"]), None)


def test_no_preset_is_the_default():
    cfg = compose_config([])
    assert cfg.model.tiny and cfg.pipeline.memory_budget_gb is None
    assert cfg.hydra.runtime.choices.experiment is None


@pytest.mark.parametrize("override", ["experiment=flux_lora_8gb", "+experiment=nope",
                                      "experiment=flux_lora_24gb,nope"])
def test_an_unknown_preset_is_refused_with_the_presets_named(override):
    with pytest.raises(ConfigError, match="no such preset") as info:
        compose_config([override, "model.path=/models/x"])
    assert all(name in str(info.value) for name in PRESETS)


def test_only_the_experiment_overrides_are_rewritten():
    args = ["--cfg", "job", "+experiment=flux_lora_24gb", "optim.lr=1e-4", "-m"]
    assert preset_overrides(args) == ["--cfg", "job", "experiment=flux_lora_24gb",
                                      "optim.lr=1e-4", "-m"]


def test_the_cli_refuses_an_unknown_preset_in_one_line(capsys, monkeypatch):
    import sys

    from dpipe.cli import train

    monkeypatch.setattr(sys, "argv", ["dpipe-train", "+experiment=nope"])
    with pytest.raises(SystemExit) as info:
        train.main()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: experiment=nope: no such preset") and "flux_lora_24gb" in err


def test_the_video_presets_make_480x832_buckets():
    from dpipe.data.buckets import aspect_ratios, bucket_sizes

    for name in ("wan14b_lora_24gb", "hunyuan_video_lora_2x24gb"):
        d = _run(name).dataset
        # 16: the VAE's 8x times the 2x2 patches of Wan 2.1 and HunyuanVideo.
        assert bucket_sizes(d.resolutions[0], aspect_ratios(d), 16) == \
            [(480, 832), (640, 640), (832, 480)]
        assert d.frame_buckets == [1, 33]


def weights_floor(run) -> list[int]:
    """Bytes each stage's weights take on the device as the preset runs it (every swappable
    layer swapped where `blocks_to_swap` is set, the two in flight counted), plus AdamW's two
    moments of the LoRA weights: built at real size on the meta device, made trainable and
    quantized as training does (dpipe.train.trainable), split as the engine splits it."""
    from dpipe.models.registry import build_spec
    from dpipe.pipeline.block_swap import first_swappable, swappable
    from dpipe.pipeline.engine import weights_on_device
    from dpipe.pipeline.partition import stage_bounds
    from dpipe.train.trainable import trainable_layers

    size = BENCH_SIZE[run.model.family]
    spec = build_spec(run.model).for_benchmark(size)
    layers = trainable_layers(spec, run, spec.random_denoiser(size, torch.float32,
                                                                torch.device("meta")))
    p = run.pipeline
    bounds = stage_bounds(spec.layer_costs(layers), p.stages, p.partition, p.split)
    stages = [layers[bounds[s]:bounds[s + 1]] for s in range(p.stages)]
    if p.blocks_to_swap == "auto":
        own = [swappable(stage) for stage in stages]
    else:
        own = [{i: t for i, t in swappable(stage).items()
                if i in first_swappable(stage, int(p.blocks_to_swap))} for stage in stages]
    moments = [sum(2 * q.numel() * 4 for layer in stage for q in layer.parameters()
                   if q.requires_grad) for stage in stages]
    return [w + m for w, m in zip(weights_on_device(stages, own), moments)]


def test_the_budget_holds_the_weights_at_real_size():
    """The budget of flux_lora_16gb's plan on its machine (the tightest of the presets) covers
    the weights the engine keeps on the device and the planner's fragmentation margin: the
    least any plan can reach, before activations (which the first step measures on the GPU).
    The engine refuses a budget below the weights with every layer swapped
    (`_check_budget_reachable`); this counts them as the engine does, where the plan's own
    fit (tests/unit/test_plan.py, every preset) counts them from its footprint."""
    from dpipe.config.checks import validate
    from dpipe.pipeline.memory import fragmentation_margin

    name = "flux_lora_16gb"
    cfg = compose_config([f"experiment={name}", "model.path=/models/x"])
    apply_auto_pipeline(cfg, cfg.hydra, plan_machine(cfg, None))
    run = validate(cfg, world_size=cfg.pipeline.stages)
    budget = int(run.pipeline.memory_budget_gb * GiB)
    floor = max(weights_floor(run)) + fragmentation_margin(budget)
    assert floor <= budget, (f"{name}: {floor / GiB:.2f} GiB of weights and margin, over the "
                             f"{budget / GiB:g} GiB budget")
