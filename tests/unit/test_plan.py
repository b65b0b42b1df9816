"""dpipe.plan on emulated machines, with real-size models built on the meta device (no weights,
no GPU): the table of docs/performance.md is consistent, agrees with the hand-chosen presets and
with the GPU runs measured so far, and `dpipe-train --plan` names the change for a run that does
not fit. The footprints are built once per module (dpipe.plan.table caches them: ~10 s of CPU for
the six models)."""

from __future__ import annotations

import itertools
import json

import pytest
import yaml
from omegaconf import OmegaConf

from dpipe.plan import table
from dpipe.plan.choose import choose, layout
from dpipe.plan.machine import GiB, parse

pytestmark = pytest.mark.slow  # the real-size meta builds: ~10 s of CPU in all


def _dominates(big: str, small: str) -> bool:
    a, b = parse(big), parse(small)
    return (a.gpus, a.gpu_gib, a.host_gib) >= (b.gpus, b.gpu_gib, b.host_gib) and \
        a.gpus >= b.gpus and a.gpu_gib >= b.gpu_gib and a.host_gib >= b.host_gib


@pytest.mark.parametrize("name", table.MODELS)
def test_more_memory_never_gives_a_slower_plan_nor_one_that_does_not_fit(name):
    plans = {m: table.plan(name, m) for m in table.MACHINES}
    for small, big in itertools.permutations(table.MACHINES, 2):
        if not _dominates(big, small) or not plans[small].fits:
            continue
        assert plans[big].fits, f"{name}: fits {small}, not {big}: {plans[big].problems}"
        assert plans[big].seconds_per_sample <= plans[small].seconds_per_sample * (1 + 1e-9), \
            (name, small, big)
    # Each fitting plan keeps its stages within the budget and uses no more GPUs than there are.
    for machine, plan in plans.items():
        if plan.fits:
            assert plan.stages * plan.data_parallel <= parse(machine).gpus
            assert all(s.peak <= s.planned <= plan.budget for s in plan.stage_plans)


def test_what_fits_where():
    """The table's headline facts: a FLUX.1-dev LoRA needs fp8 below 80 GiB and none above; a
    full fine-tune of it fits no GPUs of the table but 8x80 GiB (as 2 stages: each worker
    reads its stage's half, so any host of the table holds the loading); a 32 GiB host
    holds its loading (each worker reads its stage's weights in bf16: 26.5 GiB), a 24 GiB host
    does not."""
    flux = {m: table.plan("FLUX.1-dev LoRA", m) for m in ("1x16,host=64", "1x24,host=64",
                                                          "1x80,host=128", "1x24,host=32",
                                                          "1x24,host=24")}
    assert [flux[m].base for m in ("1x16,host=64", "1x24,host=64", "1x80,host=128")] == \
        ["fp8", "fp8", "bf16"]
    assert sum(s.recompute for s in flux["1x80,host=128"].stage_plans) == 0
    assert flux["1x24,host=32"].fits
    assert flux["1x24,host=32"].host_peak == (
        "loading the denoiser (each process its stage)", pytest.approx(26.5 * GiB, rel=0.01))
    assert not flux["1x24,host=24"].fits
    assert "loading the denoiser" in flux["1x24,host=24"].problems[0]
    full = [m for m in table.MACHINES if table.plan("FLUX.1-dev full fine-tune", m).fits]
    assert full == ["8x80,host=32", "8x80,host=64", "8x80,host=128"]
    assert table.plan("FLUX.1-dev full fine-tune", "8x80,host=32").stages == 2


def test_int8_compute_plans_int8_weights_without_a_base_dtype_key():
    """`model.base_compute=int8` stores the weights in int8: the plan counts 8-bit weights where
    bf16 would fit, and its keys (what `--plan` prints and `pipeline=auto` sets) name no
    model.base_dtype (its fp8 would be refused beside int8 compute)."""
    from dataclasses import replace

    from dpipe.config.schema import BaseCompute

    run = table.model_run("FLUX.1-dev LoRA")
    int8 = replace(run, model=replace(run.model, base_compute=BaseCompute.int8))
    for machine in ("1x24,host=64", "1x80,host=128"):
        plan = choose(table.footprint("FLUX.1-dev LoRA"), int8, parse(machine))
        assert plan.fits and plan.base == "int8", (machine, plan.base)
        assert not any(k.startswith("model.base_dtype") for k in plan.overrides), plan.overrides


# What each preset chose by hand before it named its machine (pipeline.machine) and left the
# rest to pipeline=auto (a 15 GiB budget on 16 GB, 23 GiB on 24 GB; fp8 base weights; auto
# recompute; block swap but for flux_lora_24gb; one stage but for HunyuanVideo's two).
HAND_CHOSEN = {
    "flux_lora_16gb": ["pipeline=single", "pipeline.memory_budget_gb=15",
                       "pipeline.blocks_to_swap=auto"],
    "flux_lora_24gb": ["pipeline=single", "pipeline.memory_budget_gb=23"],
    "wan14b_lora_24gb": ["pipeline=single", "pipeline.memory_budget_gb=23",
                         "pipeline.blocks_to_swap=auto"],
    "qwen_image_lora_24gb": ["pipeline=single", "pipeline.memory_budget_gb=23",
                             "pipeline.blocks_to_swap=auto"],
    "hunyuan_video_lora_2x24gb": ["pipeline=two_stage", "pipeline.memory_budget_gb=23",
                                  "pipeline.blocks_to_swap=auto"],
}


@pytest.mark.parametrize("preset", HAND_CHOSEN)
def test_each_preset_plans_for_its_machine_no_slower_than_it_chose_by_hand(preset):
    """With no GPU visible, a preset's plan is for the machine it names: it fits, keeps the
    memory budget chosen by hand, and is no slower by the plan's estimate than the hand-chosen
    keys on the same machine (which fit too)."""
    from dpipe.cli.train_plan import fixed_keys, plan_machine
    from dpipe.config.checks import validate
    from dpipe.config.compose import compose_config, compose_run
    from dpipe.config.experiments import presets

    assert set(HAND_CHOSEN) == set(table.PRESETS) == set(presets())
    name, hand = table.PRESETS[preset], HAND_CHOSEN[preset]
    args = [f"experiment={preset}", "model.path=/models/x"]
    cfg = compose_config(args)
    machine = plan_machine(cfg, None)
    assert machine is not None and fixed_keys(cfg.hydra) == set()  # the plan chooses them all
    ours = choose(table.footprint(name), validate(cfg), machine, fixed_keys(cfg.hydra))
    by_hand = [*args, *hand, "model.base_dtype=fp8", "pipeline.activation_checkpointing=auto"]
    run = compose_run(by_hand, world_size=compose_config(by_hand).pipeline.stages)
    theirs = layout(table.footprint(name), run, machine, run.pipeline.stages,
                    machine.gpus // run.pipeline.stages, True)
    assert theirs.fits, theirs.problems
    assert ours.fits and ours.budget == theirs.budget == int(run.pipeline.memory_budget_gb * GiB)
    assert ours.seconds_per_sample <= theirs.seconds_per_sample * (1 + 1e-9)
    assert ours.stages * ours.data_parallel <= machine.gpus
    assert table.preset_plan(preset) == ours  # the row of docs/performance.md's preset table


def test_plan_on_a_preset_without_a_gpu_prints_what_the_launch_applies(capsys, monkeypatch):
    """`dpipe-train --plan experiment=flux_lora_16gb ...` on this machine (no GPU, no --machine)
    prints the plan for the preset's machine, and its keys are those dpipe-train sets before
    starting the preset's run here."""
    import sys

    from dpipe.cli import train
    from dpipe.cli.train_plan import apply_auto_pipeline, plan_machine
    from dpipe.config.compose import compose_config

    args = ["experiment=flux_lora_16gb", "model.path=/models/FLUX.1-dev"]
    monkeypatch.setattr(sys, "argv", ["dpipe-train", "--plan", *args])
    train.main()  # returns: the plan fits (exit status 0)
    out = capsys.readouterr().out
    assert out.startswith("plan for 1 GPU with 15 GiB free, 64 GiB host: flux (dev, "), out
    keys = next(line for line in out.splitlines() if line.startswith("  keys: "))
    cfg = compose_config(args)
    apply_auto_pipeline(cfg, cfg.hydra, plan_machine(cfg, None))
    printed = {k: yaml.safe_load(v) for k, v in (kv.split("=") for kv in keys.split()[1:])}
    applied = {k: getattr(v, "value", v) for k in printed  # an enum's value
               for v in [OmegaConf.select(cfg, k)]}
    assert printed == applied
    assert printed["model.base_dtype"] == "fp8" and printed["pipeline.blocks_to_swap"] == "auto"


def test_the_measured_flux_runs():
    """FLUX.1-dev LoRA r32 at 1024^2 on one H200, compiled (docs/performance.md, target 4):
    bf16 base without recompute peaked at 54.2 GiB (the calibration of the activations), fp8
    base at 43.2 GiB (not calibrated on), and fp8 with `auto` under a 24 GiB cap recomputed 45
    of 59 layers."""
    from dataclasses import replace

    name = "FLUX.1-dev LoRA"
    run = table.model_run(name)
    h200 = parse("1x141,host=512")
    none = replace(run, pipeline=replace(run.pipeline, activation_checkpointing="none"))
    fp = table.footprint(name)
    assert layout(fp, none, h200, 1, 1, False).stage_plans[0].peak / GiB == \
        pytest.approx(54.2, rel=0.1)
    assert layout(fp, none, h200, 1, 1, True).stage_plans[0].peak / GiB == \
        pytest.approx(43.2, rel=0.1)
    auto = replace(run, pipeline=replace(run.pipeline, activation_checkpointing="auto",
                                         memory_budget_gb=24.0))
    capped = layout(fp, auto, h200, 1, 1, True).stage_plans[0]
    assert capped.recompute == pytest.approx(45, abs=6) and capped.peak <= 24 * GiB


def test_plan_prints_the_smallest_change_for_a_run_that_does_not_fit(capsys, monkeypatch,
                                                                      tmp_path):
    """The user's command for their 24 GB card in a 24 GiB host, with FLUX.1-dev as ComfyUI's
    single file: it cannot load it, and the plan says how much host memory would do. Each
    worker reads its stage's tensors of the file as of a folder (26.5 GiB, not the 48 GiB of
    the whole fp32 load)."""
    import sys

    from dpipe.cli import train

    folder = tmp_path / "FLUX.1-dev"  # the configs' folder: the plan reads none of it
    folder.mkdir()
    monkeypatch.setattr(sys, "argv", [
        "dpipe-train", "--plan", "--machine", "1x24,host=24", "model=flux",
        "model.path=/models/flux1-dev.safetensors", f"model.single_file_config={folder}",
        "dataset=folder", "dataset.path=/data/photos",
        "dataset.resolutions=[1024]", "train.precision=bf16"])
    with pytest.raises(SystemExit) as info:
        train.main()
    out = capsys.readouterr().out
    assert info.value.code == 1, out
    assert "does not fit: loading the denoiser (each process its stage) needs 26 GiB of host " \
           "memory, the host has 24 GiB" in out
    assert "smallest change that fits: 32 GiB of host memory (this machine: 24)" in out
    assert "model.base_dtype=fp8" in out  # the keys of the plan that fits


@pytest.mark.parametrize("text", ["24", "2x", "1x24,ram=64"])
def test_a_bad_machine_is_refused_in_one_line(text, capsys, monkeypatch):
    import sys

    from dpipe.cli import train

    monkeypatch.setattr(sys, "argv", ["dpipe-train", "--plan", "--machine", text])
    with pytest.raises(SystemExit) as info:
        train.main()
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: --machine {text}: give GPUs x GiB")


def test_pipeline_auto_applies_the_plan_and_keeps_what_the_user_set(tmp_path):
    """`pipeline=auto` on an emulated 2x24 GiB machine with a 128 GiB host: FLUX.1-dev's LoRA
    as the plan chooses it (one stage per GPU, fp8, auto recompute and swap), and
    `model.base_dtype=int8` on the command line stays int8. Resumed from a checkpoint where the
    plan would differ (1x80 GiB), the run keeps its checkpoint's layout (its run.yaml's keys),
    but for a key the user sets then. On a CPU it runs as composed: two stages (the demo's)."""
    from dpipe.cli.train_plan import apply_auto_pipeline, planned_before
    from dpipe.config.checks import validate
    from dpipe.config.compose import compose_config, compose_run
    from dpipe.launch.run_rank import save_run_config

    args = ["pipeline=auto", "model=flux", "model.path=/models/x", "train.precision=bf16",
            "dataset.resolutions=[1024]"]
    cfg = compose_config(args)
    assert apply_auto_pipeline(cfg, cfg.hydra, parse("2x24,host=128")).startswith(
        "pipeline=auto:\nplan for 2 GPUs with 23 GiB free")
    p, m = cfg.pipeline, cfg.model
    assert (p.stages, p.data_parallel, m.base_dtype, p.activation_checkpointing,
            p.memory_budget_gb, p.blocks_to_swap) == (1, 2, "fp8", "auto", 23, "auto")
    save_run_config(validate(cfg, world_size=2), tmp_path)
    resumed = compose_config(args)
    assert planned_before(resumed, resumed.hydra, tmp_path) is None  # no checkpoint yet
    (tmp_path / "checkpoints" / "step_00000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000004" / "COMPLETE").touch()
    assert planned_before(resumed, resumed.hydra, tmp_path).startswith(
        "pipeline=auto: resuming, so the plan of the run's earlier start (its run.yaml) stays: "
        "pipeline.stages=1 pipeline.data_parallel=2 ")
    assert table.plan("FLUX.1-dev LoRA", "1x80,host=128").overrides[:2] == [
        "pipeline.stages=1", "pipeline.data_parallel=1"]  # what a fresh plan there would be
    p, m = resumed.pipeline, resumed.model
    assert (p.stages, p.data_parallel, m.base_dtype, p.memory_budget_gb) == (1, 2, "fp8", 23)
    mine = compose_config([*args, "pipeline.memory_budget_gb=20"])
    planned_before(mine, mine.hydra, tmp_path)
    assert mine.pipeline.memory_budget_gb == 20 and mine.pipeline.data_parallel == 2
    cfg = compose_config([*args, "model.base_dtype=int8"])
    apply_auto_pipeline(cfg, cfg.hydra, parse("2x24,host=128"))
    assert cfg.model.base_dtype == "int8" and cfg.pipeline.data_parallel == 2
    cpu = compose_run(["pipeline=auto"])
    assert cpu.pipeline.auto and cpu.pipeline.stages == 2
    cfg = compose_config(["pipeline=auto"])
    assert apply_auto_pipeline(cfg, cfg.hydra, parse("0x24")) is None


def test_pipeline_auto_under_torchrun_uses_every_process_it_was_given():
    """torchrun (or SLURM) started 4 processes on a 4x24 GiB machine with a 32 GiB host: on its
    own the plan would use 2 of the GPUs (2 stages, 1 replica: the host holds no more loading),
    which the 4 processes cannot run; the plan of 4 processes is refused, naming the host."""
    from dpipe.cli.train_plan import apply_auto_pipeline
    from dpipe.config.compose import compose_config
    from dpipe.errors import ConfigError

    args = ["pipeline=auto", "model=flux", "model.path=/models/x", "train.precision=bf16",
            "dataset.resolutions=[1024]"]
    alone = table.plan("FLUX.1-dev LoRA", "4x24,host=32")
    assert alone.stages * alone.data_parallel == 2
    cfg = compose_config(args)
    with pytest.raises(ConfigError, match=r"^pipeline=auto: nothing fits 4 GPUs .* 32 GiB host: "
                       r"loading the denoiser .* the smallest change that fits: 64 GiB of host"):
        apply_auto_pipeline(cfg, cfg.hydra, parse("4x24,host=32"), world=4)
    cfg = compose_config(args)
    apply_auto_pipeline(cfg, cfg.hydra, parse("4x24,host=64"), world=4)
    assert cfg.pipeline.stages * cfg.pipeline.data_parallel == 4


def test_pipeline_auto_refuses_a_run_that_nothing_fits():
    from dpipe.cli.train_plan import apply_auto_pipeline
    from dpipe.config.compose import compose_config
    from dpipe.errors import ConfigError

    cfg = compose_config(["pipeline=auto", "model=flux", "model.path=/models/x",
                          "train.precision=bf16", "dataset.resolutions=[1024]"])
    with pytest.raises(ConfigError, match=r"^pipeline=auto: nothing fits 1 GPU with 23 GiB free, "
                       r"24 GiB host: loading the denoiser \(each process its stage\) needs 26 "
                       r"GiB of host memory, the host has 24 GiB; the smallest change that fits: "
                       r"32 GiB of host memory"):
        apply_auto_pipeline(cfg, cfg.hydra, parse("1x24,host=24"))


def test_a_run_that_cannot_fit_is_refused_before_its_workers_start(tmp_path):
    """What a GPU run checks before its workers start (dpipe-train on a machine with GPUs):
    FLUX.1-dev LoRA in bf16 on one 16 GiB card (its weights alone are 22 GiB), and in fp8 in a
    24 GiB host (its worker reads the denoiser in bf16: 26 GiB); the same run in fp8 on 1x16
    GiB with 64 GiB passes, with the prediction to log."""
    from dpipe.cli.train_plan import check_fits
    from dpipe.config.compose import compose_run
    from dpipe.errors import ConfigError
    from dpipe.models.registry import build_spec

    # The synthetic dataset's folder not made yet (another test may have made the default
    # one): no files to count, so no cache disk in the prediction.
    args = ["model=flux", "model.path=/models/x", "train.precision=bf16", "pipeline=single",
            "dataset.resolutions=[1024]", "pipeline.activation_checkpointing=auto",
            f"dataset.path={tmp_path / 'synthetic'}"]
    run = compose_run(args, world_size=1)
    with pytest.raises(ConfigError, match=r"^this run does not fit 1 GPU with 15 GiB free, 64 GiB "
                       r"host: stage 0.s weights and trained state alone take 25.7 GiB"):
        check_fits(run, build_spec(run.model), parse("1x16,host=64"), 1)
    run = compose_run([*args, "model.base_dtype=fp8", "pipeline.blocks_to_swap=auto"],
                      world_size=1)
    with pytest.raises(ConfigError, match="loading the denoiser .* needs 26 GiB of host memory"):
        check_fits(run, build_spec(run.model), parse("1x16,host=24"), 1)
    assert check_fits(run, build_spec(run.model), parse("1x16,host=64"), 1, tmp_path).startswith(
        "plan: predicted GPU peak per stage ")
    # The prediction the run's end compares with: <run>/plan.json, before any worker starts.
    predicted = json.loads((tmp_path / "plan.json").read_text())["predicted"]
    assert len(predicted["gpu_peak_per_stage"]) == 1 and predicted["cache_disk"] is None
    assert 10 * GiB < predicted["gpu_peak_per_stage"][0] <= 15 * GiB


def test_a_family_without_a_real_size_config_is_refused_in_one_line():
    from dpipe.config.compose import compose_run
    from dpipe.errors import ConfigError
    from dpipe.models.registry import build_spec
    from dpipe.plan.for_run import plan_run

    run = compose_run(["model=sdxl", "model.path=/models/x", "pipeline=single"], world_size=1)
    with pytest.raises(ConfigError, match="^model.family=sdxl: dpipe has no real-size config"):
        plan_run(build_spec(run.model), run, parse("1x24"), set())


def test_a_cache_disk_too_small_is_refused_with_the_space_it_needs(tmp_path):
    """The tiny FLUX.1 model and a folder of 3 images at 512^2: their latents and text entries
    take ~0.1 MiB; a disk with 10 KiB free is refused before any worker starts."""
    from dpipe.cli.train_plan import check_fits
    from dpipe.config.compose import compose_run
    from dpipe.errors import ConfigError
    from dpipe.models.registry import build_spec

    for i in range(3):
        (tmp_path / f"{i}.png").write_bytes(b"")
    run = compose_run(["model=tiny_flux", f"model.path={tmp_path}/tiny", "dataset=folder",
                       f"dataset.path={tmp_path}", "pipeline=single"], world_size=1)
    spec = build_spec(run.model)
    with pytest.raises(ConfigError, match=r"the cache needs 0\.1 MiB, the cache disk has 0\.0 "
                       r"MiB free"):
        check_fits(run, spec, parse(f"1x24,disk={0.01 / 1024}"), 1)
    assert "cache 0." in check_fits(run, spec, parse("1x24,disk=1"), 1)


def real_size_gguf(out, quant: str = "Q8_0"):
    """FLUX.1-dev's transformer as a `quant` GGUF in city96's layout (BFL's names, each 2-D
    weight whose rows split into blocks in `quant`, the rest F32): its real header, the data
    never written (a sparse file of the size the header says)."""
    import gguf
    import numpy as np
    import torch
    from diffusers import FluxTransformer2DModel

    from dpipe.models.common.bfl_layout import flux1_layout, to_bfl
    from dpipe.models.flux.sizes import FLUX1_DEV

    with torch.device("meta"):
        model = FluxTransformer2DModel(**{k: v for k, v in FLUX1_DEV.items()
                                          if not k.startswith("_")})
    qtype = gguf.GGMLQuantizationType[quant]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    writer = gguf.GGUFWriter(str(out), arch="flux")
    data = 0
    for name, t in to_bfl(model.state_dict(), flux1_layout(FLUX1_DEV)).items():
        if name.endswith(".weight") and t.dim() == 2 and t.shape[1] % block == 0:
            shape = (t.shape[0], t.shape[1] // block * size)
            writer.add_tensor_info(name, shape, np.dtype(np.uint8), shape[0] * shape[1],
                                   raw_dtype=qtype)
            data += shape[0] * shape[1]
        else:
            writer.add_tensor_info(name, tuple(t.shape), np.dtype(np.float32), 4 * t.numel())
            data += 4 * t.numel()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with open(out, "r+b") as f:  # room for every tensor and its alignment
        f.truncate(out.stat().st_size + data + 32 * (len(model.state_dict()) + 1))
    return out


def test_the_plan_counts_a_gguf_base_as_stored(tmp_path):
    """FLUX.1-dev LoRA from a Q8_0 GGUF on a 24 GB card in a 32 GiB host: each worker reads
    its stage's tensors of the file, its block Linears kept as stored (34 bytes a 32-value
    block), so loading takes 15.8 GiB, not the 26.5 GiB of the same stage in bf16 (the plain
    file's figure), nor the 48 GiB of the whole fp32 load every process made before."""
    from dpipe.config.compose import compose_run
    from dpipe.models.common.gguf_files import stored_value_bytes
    from dpipe.models.registry import build_spec
    from dpipe.plan.for_run import plan_run

    folder = tmp_path / "FLUX.1-dev"  # the configs' folder: the plan reads none of it
    folder.mkdir()
    file = real_size_gguf(tmp_path / "flux1-dev-Q8_0.gguf")
    assert stored_value_bytes(file) == 34 / 32
    peaks = {}
    for path in ("/models/flux1-dev.safetensors", file):
        run = compose_run(["model=flux", f"model.path={path}",
                           f"model.single_file_config={folder}", "dataset.resolutions=[1024]",
                           "train.precision=bf16", "pipeline.stages=1"], world_size=1)
        plan = plan_run(build_spec(run.model), run, parse("1x24,host=32"), set()).plan
        assert plan.fits and (plan.stages, plan.data_parallel) == (1, 1)
        peaks[str(path)] = plan.host_peak
    assert peaks["/models/flux1-dev.safetensors"] == (
        "loading the denoiser (each process its stage)", pytest.approx(26.5 * GiB, rel=0.01))
    assert peaks[str(file)] == (
        "loading the denoiser (each process its stage)", pytest.approx(15.8 * GiB, rel=0.01))


def real_size_fp8_scaled(out):
    """FLUX.1-dev's transformer as ComfyUI's scaled-fp8 single file (BFL's names under its
    prefix, the blocks' 2-D weights F8_E4M3 with a `scale_weight` each, the rest BF16, the
    `scaled_fp8` marker): its real header, the data never written (a sparse file)."""
    import struct

    import torch
    from diffusers import FluxTransformer2DModel

    from dpipe.models.common.bfl_layout import flux1_layout, to_bfl
    from dpipe.models.flux.sizes import FLUX1_DEV

    with torch.device("meta"):
        model = FluxTransformer2DModel(**{k: v for k, v in FLUX1_DEV.items()
                                          if not k.startswith("_")})
    header, end = {}, 0

    def add(name, dtype, shape, size):
        nonlocal end
        header["model.diffusion_model." + name] = {"dtype": dtype, "shape": list(shape),
                                                   "data_offsets": [end, end + size]}
        end += size

    for name, t in to_bfl(model.state_dict(), flux1_layout(FLUX1_DEV)).items():
        if name.endswith(".weight") and t.dim() == 2 and "blocks." in name:
            add(name, "F8_E4M3", t.shape, t.numel())
            add(name.removesuffix(".weight") + ".scale_weight", "F32", (), 4)
        else:
            add(name, "BF16", t.shape, 2 * t.numel())
    add("scaled_fp8", "F8_E4M3", (0,), 0)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + end)
    return out


def test_the_gpu_holds_a_quantized_base_as_stored(tmp_path):
    """FLUX.1-dev LoRA on one 80 GB card, no block swap: the frozen base on the GPU is its
    blocks' Linears as the run keeps them: bf16 from a folder; from a scaled-fp8 file its 8-bit
    values and an fp32 scale a row; from a Q8_0 GGUF its blocks, 34 bytes a 32-value block
    (model.base_dtype does not apply to a GGUF, and is none of its plan's keys). A matmul's
    dequantized weight adds to the transient: the largest Linear at 2 bytes a value from the
    8-bit file (cast to bf16), 12 from the GGUF (dequantized in fp32, then cast)."""
    from dpipe.config.compose import compose_run
    from dpipe.models.registry import build_spec
    from dpipe.plan.for_run import plan_run

    folder = tmp_path / "FLUX.1-dev"  # the configs' folder: the plan reads none of it
    folder.mkdir()
    files = {"fp8_scaled": real_size_fp8_scaled(tmp_path / "flux1-dev-fp8_scaled.safetensors"),
             "Q8_0": real_size_gguf(tmp_path / "flux1-dev-Q8_0.gguf")}
    fixed = {"pipeline.stages", "pipeline.blocks_to_swap", "model.base_dtype"}
    plans = {}
    for name, path in {"folder": "/models/FLUX.1-dev", **files}.items():
        single = [f"model.single_file_config={folder}"] if name in files else []
        run = compose_run(["model=flux", f"model.path={path}", *single,
                           "dataset.resolutions=[1024]", "train.precision=bf16",
                           "pipeline.stages=1", "pipeline.blocks_to_swap=0"], world_size=1)
        plans[name] = plan_run(build_spec(run.model), run, parse("1x80,host=64"), fixed)
    layers = plans["folder"].footprint.layers
    values = sum(x.quantizable for x in layers)  # the blocks' frozen Linear weights
    rows = sum(x.quantizable_rows for x in layers)
    largest = max(x.largest_linear for x in layers)
    assert (values, largest) == (11_834_228_736, 3072 * 18432)  # norm1.linear's 6 x 3072 rows
    stage = {name: rp.plan.stage_plans[0] for name, rp in plans.items()}
    assert {name: rp.plan.base for name, rp in plans.items()} == {
        "folder": "bf16", "fp8_scaled": "8-bit file", "Q8_0": "GGUF file"}
    assert stage["folder"].weights / GiB == pytest.approx(22.17, abs=0.01)
    assert stage["fp8_scaled"].weights == pytest.approx(
        stage["folder"].weights - values + 4 * rows, abs=len(layers))
    assert stage["Q8_0"].weights == pytest.approx(
        stage["folder"].weights - values * (2 - 34 / 32), abs=len(layers))
    assert stage["Q8_0"].weights / GiB == pytest.approx(11.84, abs=0.01)
    assert stage["fp8_scaled"].transient - stage["folder"].transient == 2 * largest
    assert stage["Q8_0"].transient - stage["folder"].transient == 12 * largest
    assert not any("base_dtype" in key for key in plans["Q8_0"].plan.overrides)


def test_a_gguf_run_that_does_not_fit_is_told_what_applies_to_it(tmp_path, capsys,
                                                                  monkeypatch):
    """FLUX.1-dev LoRA from a Q8_0 GGUF on a 16 GB card with recompute and swap fixed off: the
    change that fits is recompute and block swap, never model.base_dtype (a GGUF's blocks are
    its storage: dpipe.config.checks refuses the key with one), and the plan of the change keeps
    the GGUF's blocks."""
    import sys

    from dpipe.cli import train

    folder = tmp_path / "FLUX.1-dev"
    folder.mkdir()
    file = real_size_gguf(tmp_path / "flux1-dev-Q8_0.gguf")
    monkeypatch.setattr(sys, "argv", [
        "dpipe-train", "--plan", "--machine", "1x16,host=64", "model=flux", f"model.path={file}",
        f"model.single_file_config={folder}", "dataset.resolutions=[1024]",
        "train.precision=bf16", "model.base_dtype=auto", "pipeline.activation_checkpointing=none",
        "pipeline.blocks_to_swap=0"])
    with pytest.raises(SystemExit) as info:
        train.main()
    out = capsys.readouterr().out
    assert info.value.code == 1, out
    assert "base weights GGUF file" in out and "base_dtype" not in out, out
    assert "smallest change that fits: pipeline.activation_checkpointing=auto " \
           "pipeline.blocks_to_swap=auto" in out and "base GGUF file" in out, out


def test_plan_json_predicts_the_host_peaks_plan_prints(tmp_path, capsys, monkeypatch):
    """FLUX.1-dev LoRA from a Q8_0 GGUF in two stages on 2x24 GiB: the host peak per process
    the launcher writes to <run>/plan.json before the workers start is each stage's loading
    figure of the plan `dpipe-train --plan` prints for the same command (before: each worker
    wrote its own estimate, its 8-bit Linears in bf16 and no batch in transit)."""
    import sys

    from dpipe.cli import train
    from dpipe.cli.train_plan import check_fits
    from dpipe.config.compose import compose_run
    from dpipe.models.registry import build_spec
    from dpipe.plan.for_run import plan_run

    folder = tmp_path / "FLUX.1-dev"
    folder.mkdir()
    file = real_size_gguf(tmp_path / "flux1-dev-Q8_0.gguf")
    args = ["model=flux", f"model.path={file}", f"model.single_file_config={folder}",
            "dataset.resolutions=[1024]", "train.precision=bf16", "pipeline.stages=2",
            "pipeline.data_parallel=1", "pipeline.partition=balanced",
            f"dataset.path={tmp_path / 'none'}"]
    machine = parse("2x24,host=64")
    run = compose_run(args, world_size=2)
    spec = build_spec(run.model)
    check_fits(run, spec, machine, 1, tmp_path)
    predicted = json.loads((tmp_path / "plan.json").read_text())["predicted"]
    plan = plan_run(spec, run, machine, {"pipeline.stages", "pipeline.data_parallel"}).plan
    assert predicted["host_peak_per_process"] == plan.loading_per_process
    step = "loading the denoiser (each process its stage)"
    assert sum(plan.loading_per_process) == plan.host[step]
    monkeypatch.setattr(sys, "argv", ["dpipe-train", "--plan", "--machine", "2x24,host=64",
                                      *args])
    train.main()
    printed = f"{step} {sum(predicted['host_peak_per_process']) / GiB:.1f};"
    assert printed in capsys.readouterr().out
