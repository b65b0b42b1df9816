"""Resuming with a changed config: what a checkpoint cannot follow fails clearly, the rest is
allowed and logged. Also: the launcher and cluster presets compose as documented."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from dpipe.config.checks import validate
from dpipe.config.store import register_schemas
from dpipe.errors import ConfigError
from dpipe.launch.summary import PointResult, write_summary
from dpipe.launch.sweep import register_launchers
from dpipe.train.engine_setup import apply_optim_config
from dpipe.models.fingerprint import sha256_of
from dpipe.train.checkpoint import MARKER, check_resume, resume_changes, tag_for
from dpipe.train.optim import build_optimizer
from dpipe.train.schedule import lr_lambda

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def compose_run(*overrides: str):
    register_schemas()
    register_launchers()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # `name` interpolates Hydra's runtime choices
    return cfg


def run_yaml(*overrides: str) -> str:
    cfg = compose_run(*overrides)
    return OmegaConf.to_yaml(OmegaConf.structured(validate(cfg)))


def fake_checkpoint(run_dir: Path, step: int, config_yaml: str | None) -> Path:
    path = run_dir / "checkpoints" / tag_for(step)
    path.mkdir(parents=True)
    if config_yaml is not None:
        (path / "config.yaml").write_text(config_yaml)
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_of(p)} for p in path.iterdir()}
    (path / MARKER).write_text(json.dumps({"step": step, "files": files}))  # as save() lists them
    return path


def test_incompatible_changes_fail_naming_each_key(tmp_path):
    fake_checkpoint(tmp_path, 40, run_yaml("model.lora.rank=4", "pipeline.stages=2"))
    with pytest.raises(ConfigError) as err:
        check_resume(tmp_path, run_yaml("model.lora.rank=8", "pipeline.stages=1",
                                         "optim.lr=5e-5"))
    message = str(err.value)
    assert "model.lora.rank: 4 in the checkpoint, 8 now" in message
    assert "pipeline.stages: 2 in the checkpoint, 1 now" in message
    assert "optim.lr" not in message  # harmless: not listed among the blockers
    assert "name=" in message and "train.resume=false" in message and "step_00000040" in message


def test_sound_cannot_be_switched_on_or_off_on_resume(tmp_path):
    fake_checkpoint(tmp_path, 8, run_yaml("model=tiny_ltx2"))
    with pytest.raises(ConfigError, match="model.audio: False in the checkpoint, True now"):
        check_resume(tmp_path, run_yaml("model=tiny_ltx2", "model.audio=true"))


def test_harmless_changes_are_allowed_and_logged(tmp_path, caplog):
    fake_checkpoint(tmp_path, 10, run_yaml())
    fake_checkpoint(tmp_path, 20, run_yaml())
    with caplog.at_level(logging.INFO, logger="dpipe"):
        step, path = check_resume(tmp_path, run_yaml("optim.lr=5e-5", "train.max_steps=500",
                                                     "train.log_every=5"))
    assert step == 20 and path.name == "step_00000020"
    logged = caplog.text
    assert "optim.lr 0.0001 -> 5e-05" in logged and "train.max_steps" in logged
    assert "train.log_every 1 -> 5" in logged


def test_mode_and_family_and_precision_of_full_fine_tunes(tmp_path):
    incompatible, _ = resume_changes(run_yaml(), run_yaml("model.mode=full"))
    assert set(incompatible) == {"model.mode"}
    # precision only matters to full fine-tunes (DeepSpeed's bf16 optimizer state)
    incompatible, harmless = resume_changes(run_yaml(), run_yaml("train.precision=bf16"))
    assert not incompatible and "train.precision" in harmless
    full = ("model.mode=full", "pipeline.zero_stage=1")
    incompatible, _ = resume_changes(run_yaml(*full), run_yaml(*full, "train.precision=bf16"))
    assert set(incompatible) == {"train.precision"}


def test_master_weights_of_bf16_full_fine_tunes_cannot_change():
    full_bf16 = ("model.mode=full", "train.precision=bf16", "pipeline.zero_stage=1")
    incompatible, _ = resume_changes(run_yaml(*full_bf16),
                                     run_yaml(*full_bf16, "optim.master_weights=false"))
    assert set(incompatible) == {"optim.master_weights"}
    # LoRA never uses DeepSpeed's bf16 optimizer: the setting changes nothing there
    incompatible, harmless = resume_changes(run_yaml("train.precision=bf16"),
                                            run_yaml("train.precision=bf16",
                                                     "optim.master_weights=false"))
    assert not incompatible and "optim.master_weights" in harmless


def test_the_optimizer_and_full_fine_tunes_groups_cannot_change():
    incompatible, _ = resume_changes(run_yaml(), run_yaml("optim=prodigy"))
    assert "optim.name" in incompatible
    incompatible, harmless = resume_changes(run_yaml(), run_yaml("optim.weight_decay_1d=true"))
    assert not incompatible and "optim.weight_decay_1d" in harmless  # LoRA: matrices only
    incompatible, _ = resume_changes(run_yaml("model.mode=full"),
                                     run_yaml("model.mode=full", "optim.weight_decay_1d=true"))
    assert set(incompatible) == {"optim.weight_decay_1d"}
    # A checkpoint from before the key decayed every parameter (one group): refused for a
    # full fine-tune with today's default, followed with optim.weight_decay_1d=true.
    older = "\n".join(line for line in run_yaml("model.mode=full").splitlines()
                      if "weight_decay_1d" not in line)
    incompatible, _ = resume_changes(older, run_yaml("model.mode=full"))
    assert set(incompatible) == {"optim.weight_decay_1d"}
    incompatible, _ = resume_changes(older, run_yaml("model.mode=full", "optim.weight_decay_1d=true"))
    assert not incompatible


def test_param_groups_may_change_their_rates_not_their_patterns():
    before = run_yaml("optim.param_groups=[{match: lora_B, lr: 1e-3}]")
    incompatible, harmless = resume_changes(
        before, run_yaml("optim.param_groups=[{match: lora_B, lr: 2e-3}]"))
    assert not incompatible and "optim.param_groups" in harmless
    incompatible, _ = resume_changes(
        before, run_yaml("optim.param_groups=[{match: lora_A, lr: 1e-3}]"))
    assert set(incompatible) == {"optim.param_groups"}


def _adamw_with_schedule(run):
    weight = torch.nn.Parameter(torch.ones(3, 2))  # a matrix: weight decay applies
    optimizer = build_optimizer([("weight", weight)], run.optim)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(run.optim, run.train.max_steps))


def test_a_loaded_optimizer_follows_the_current_optim_settings():
    """What DeepSpeed's load does to the AdamW and its LambdaLR (load_state_dict), then the
    current optim.* replace the saved hyperparameters; the moments and schedule position stay."""
    saved_run = validate(compose_run("optim.warmup_steps=4", "train.max_steps=10"))
    optimizer, scheduler = _adamw_with_schedule(saved_run)
    for _ in range(2):
        optimizer.param_groups[0]["params"][0].grad = torch.ones(3, 2)
        optimizer.step()
        scheduler.step()
    saved = optimizer.state_dict(), scheduler.state_dict()

    run = validate(compose_run("optim.warmup_steps=4", "train.max_steps=10", "optim.lr=5e-4",
                               "optim.weight_decay=0.1", "optim.betas=[0.8,0.95]",
                               "optim.eps=1e-6", "optim.grad_clip=0.5"))
    optimizer, scheduler = _adamw_with_schedule(run)
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4 * 3 / 4)  # the saved config's
    apply_optim_config(SimpleNamespace(lr_scheduler=scheduler, optimizer=optimizer), run)
    group = optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(5e-4 * 3 / 4)  # step 3 of the 4 warm-up steps
    assert (group["weight_decay"], group["betas"], group["eps"]) == (0.1, (0.8, 0.95), 1e-6)
    assert int(optimizer.state_dict()["state"][0]["step"]) == 2  # the moments are the saved ones
    scheduler.step()
    assert group["lr"] == pytest.approx(5e-4)  # warm-up done: the new base lr

    # DeepSpeed's bf16 and ZeRO optimizers wrap the AdamW and restore the saved clipping norm.
    wrapped = validate(compose_run("model.mode=full", "pipeline.zero_stage=1",
                                   "optim.grad_clip=0.5"))
    optimizer, scheduler = _adamw_with_schedule(wrapped)
    deepspeed_optimizer = SimpleNamespace(clip_grad=1.0, param_groups=optimizer.param_groups)
    apply_optim_config(SimpleNamespace(lr_scheduler=scheduler, optimizer=deepspeed_optimizer),
                       wrapped)
    assert deepspeed_optimizer.clip_grad == 0.5


def test_no_checkpoint_or_no_saved_config(tmp_path, caplog):
    assert check_resume(tmp_path, run_yaml()) is None
    fake_checkpoint(tmp_path, 5, None)
    with caplog.at_level(logging.WARNING, logger="dpipe"):
        assert check_resume(tmp_path, run_yaml("model.lora.rank=64"))[0] == 5
    assert "without checking" in caplog.text


def test_launchers_and_cluster_presets_compose():
    cfg = compose_run("hydra/launcher=submitit_slurm")
    assert cfg.hydra.launcher._target_ == "hydra_plugins.dpipe.SlurmLauncher"
    assert cfg.hydra.launcher.signal_delay_s == 90 and cfg.hydra.launcher.tasks_per_node is None
    cfg = compose_run("cluster=slurm_gpu_2nodes")
    launcher = cfg.hydra.launcher
    assert (launcher.nodes, launcher.gpus_per_node, launcher.timeout_min) == (2, 8, 240)
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    assert compose_run("cluster=local_parallel").hydra.launcher._target_.endswith(
        "LocalLauncher")
    assert compose_run().hydra.launcher._target_ == "hydra_plugins.dpipe.BasicLauncher"
    with pytest.raises(Exception, match="partiton"):
        compose_run("cluster=slurm_cpu", "hydra.launcher.partiton=gpu")


def test_sweep_summary(tmp_path):
    runs = []
    for i, losses in enumerate([[1.0, 0.5], [1.0, 0.75]]):
        run = tmp_path / f"{i}_lr"
        run.mkdir()
        lines = [json.dumps({"step": s + 1, "loss": v}) for s, v in enumerate(losses)]
        if i == 0:
            lines.append(json.dumps({"step": 2, "eval_loss": 0.6}))
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        runs.append(run)
    md = write_summary(tmp_path, [
        PointResult(0, ["train.max_steps=2", "optim.lr=1e-4"], str(runs[0])),
        PointResult(1, ["train.max_steps=2", "optim.lr=5e-5"], str(runs[1]), "cancelled",
                    "SLURM state CANCELLED by 0", "77_1"),
    ])
    assert "All points: train.max_steps=2" in md
    assert "| 0 | optim.lr=1e-4 | completed | 2 | 0.5 | 0.6 | 0_lr |" in md
    assert "| 1 | optim.lr=5e-5 | cancelled | 2 | 0.75 |  | 1_lr |" in md
    assert "#1 (job 77_1): cancelled: SLURM state CANCELLED by 0" in md
    points = json.loads((tmp_path / "sweep_summary.json").read_text())["points"]
    assert points[0]["metrics"] == {"step": 2, "loss": 0.5, "eval_loss": 0.6}
    assert (tmp_path / "sweep_summary.md").read_text() == md
