"""DeepSpeed checkpoints in the run dir, and finding the newest *complete* one.

A checkpoint is `<run_dir>/checkpoints/step_<N>/`. Every rank writes its part, then rank 0 adds
COMPLETE (atomically) once all ranks have finished; a folder without it is a checkpoint that was
interrupted and is never loaded. The run config is saved beside it, so a resume can compare.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import torch.distributed as dist
from omegaconf import OmegaConf

from dpipe.errors import ConfigError
from dpipe.io import atomic_write_text

MARKER = "COMPLETE"
PREFIX = "step_"
CONFIG = "config.yaml"  # the resolved run config the checkpoint was written with

log = logging.getLogger("dpipe")

# Settings a checkpoint cannot follow on resume, and why. Every other change (steps, learning
# rate, schedule, logging, data, batch size, seed) is allowed, logged and applied: the optim.*
# values replace the loaded optimizer's (dpipe.pipeline.engine.apply_optim_config).
INCOMPATIBLE = {
    "model.family": "another model",
    "model.mode": "LoRA and full fine-tunes save different tensors",
    "model.lora.rank": "the LoRA tensors' shapes",
    "model.lora.alpha": "the LoRA scale the adapters were trained with",
    "model.lora.targets": "which modules have LoRA tensors",
    "pipeline.stages": "the optimizer state is saved per stage (the per-layer weights would load, "
                       "the optimizer state does not)",
    "pipeline.partition": "which layers each stage (and its optimizer state) holds",
    "pipeline.split": "which layers each stage (and its optimizer state) holds",
    "pipeline.zero_stage": "the optimizer state's layout",
}
# Full fine-tunes in bf16 keep fp32 master weights in DeepSpeed's bf16 optimizer.
INCOMPATIBLE_FULL = {"train.precision": "the optimizer state's layout (bf16 vs fp32)"}
# ...or, with optim.master_weights=false, train the bf16 weights in a plain AdamW.
INCOMPATIBLE_FULL_BF16 = {
    "optim.master_weights": "the optimizer state's layout (DeepSpeed's fp32 master weights or "
                            "a plain AdamW over the bf16 weights)",
}


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def tag_for(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.glob(f"{PREFIX}*"):
        if (path / MARKER).is_file():
            found.append((json.loads((path / MARKER).read_text())["step"], path))
    return sorted(found)


def newest_complete(run_dir: Path) -> tuple[int, Path] | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def save(engine, run_dir: Path, step: int, config_yaml: str, lora: bool, keep: int) -> Path:
    root = checkpoint_root(run_dir)
    tag = tag_for(step)
    engine.save_checkpoint(
        str(root), tag=tag, client_state={"step": step}, exclude_frozen_parameters=lora
    )
    dist.barrier()
    path = root / tag
    if dist.get_rank() == 0:
        atomic_write_text(path / CONFIG, config_yaml)
        atomic_write_text(path / MARKER, json.dumps({"step": step, "time": time.time()}))
        _prune(run_dir, keep)
    dist.barrier()
    return path


def load(engine, run_dir: Path, path: Path, lora: bool) -> int:
    _, client_state = engine.load_checkpoint(
        str(checkpoint_root(run_dir)), tag=path.name, load_module_strict=not lora
    )
    if client_state is None:
        raise RuntimeError(f"DeepSpeed could not load the checkpoint {path}")
    return int(client_state["step"])


def _prune(run_dir: Path, keep: int) -> None:
    complete = complete_checkpoints(run_dir)
    for _, path in complete[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    newest = complete[-1][0] if complete else -1
    # Interrupted checkpoints older than the newest complete one will never be used.
    for path in checkpoint_root(run_dir).glob(f"{PREFIX}*"):
        if not (path / MARKER).exists() and int(path.name[len(PREFIX):]) < newest:
            shutil.rmtree(path, ignore_errors=True)


def resume_changes(saved_yaml: str, current_yaml: str) -> tuple[dict, dict]:
    """(incompatible, harmless) differences between a checkpoint's config and the current one,
    each {key: (saved, current)}."""
    saved = _flat(OmegaConf.to_container(OmegaConf.create(saved_yaml)))
    current = _flat(OmegaConf.to_container(OmegaConf.create(current_yaml)))
    blocking = dict(INCOMPATIBLE)
    if current.get("model.mode") == "full" or saved.get("model.mode") == "full":
        blocking.update(INCOMPATIBLE_FULL)
        if "bf16" in (current.get("train.precision"), saved.get("train.precision")):
            blocking.update(INCOMPATIBLE_FULL_BF16)
    incompatible, harmless = {}, {}
    for key in sorted(set(saved) | set(current)):
        old, new = saved.get(key), current.get(key)
        if old != new:
            (incompatible if key in blocking else harmless)[key] = (old, new)
    return incompatible, harmless


def check_resume(run_dir: Path, current_yaml: str) -> tuple[int, Path] | None:
    """The checkpoint a resume will start from, after checking that the current config can use
    it: raises ConfigError naming the keys it cannot follow; logs the other changes."""
    newest = newest_complete(run_dir)
    if newest is None:
        return None
    step, path = newest
    if not (path / CONFIG).is_file():
        log.warning("checkpoint %s has no %s: resuming without checking the config", path, CONFIG)
        return newest
    incompatible, harmless = resume_changes((path / CONFIG).read_text(), current_yaml)
    if incompatible:
        why = {**INCOMPATIBLE, **INCOMPATIBLE_FULL, **INCOMPATIBLE_FULL_BF16}
        lines = "\n".join(f"  {k}: {_show(old)} in the checkpoint, {_show(new)} now ({why[k]})"
                          for k, (old, new) in incompatible.items())
        raise ConfigError(
            f"cannot resume {run_dir} from its checkpoint {path.name} (step {step}): these settings "
            f"differ from the checkpoint's, which cannot follow them:\n{lines}\n"
            "Start a new run instead: another `name=...` (or `hydra.run.dir=...`), or "
            "`train.resume=false` to train from scratch in this run dir."
        )
    if harmless:
        changes = ", ".join(f"{k} {_show(old)} -> {_show(new)}" for k, (old, new) in harmless.items())
        log.info("resuming from %s with changed settings: %s", path.name, changes)
    return newest


def _flat(node, prefix: str = "") -> dict:
    if not isinstance(node, dict):
        return {prefix.rstrip("."): node}
    out: dict = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _show(value) -> str:
    return "(unset)" if value is None else repr(value) if isinstance(value, str) else str(value)
