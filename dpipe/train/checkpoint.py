"""DeepSpeed checkpoints in the run dir, and finding the newest *complete* one.

A checkpoint is `<run_dir>/checkpoints/step_<N>/`. Every rank writes its part, then rank 0 adds
COMPLETE (atomically) once all ranks have finished; a folder without it is a checkpoint that was
interrupted and is never loaded. The run config is saved beside it, so a resume can compare.
"""

from __future__ import annotations

import json
import logging
import os
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
# rate, schedule, logging, data settings (not the dataset's folders), batch size, seed) is
# allowed, logged and applied: the optim.* values replace the loaded optimizer's
# (dpipe.pipeline.engine.apply_optim_config).
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
    saved_yaml = (path / CONFIG).read_text()
    _refuse_another_dataset(run_dir, path, step, saved_yaml, current_yaml)
    incompatible, harmless = resume_changes(saved_yaml, current_yaml)
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


def dataset_folders(config_yaml: str) -> list[str]:
    """The folders a run config trains on: `dataset.path`, then each `dataset.directories` path."""
    dataset = OmegaConf.to_container(OmegaConf.create(config_yaml)).get("dataset") or {}
    folders = [dataset["path"]] if dataset.get("path") else []
    return folders + [entry.get("path") for entry in dataset.get("directories") or []]


def _same_folder(a: str, b: str) -> bool:
    a, b = os.path.expanduser(a), os.path.expanduser(b)
    if os.path.normpath(a) == os.path.normpath(b):
        return True
    try:
        return os.path.samefile(a, b)  # another spelling (a link, a relative path) of one folder
    except OSError:
        return False


def _refuse_another_dataset(run_dir: Path, path: Path, step: int, saved_yaml: str,
                            current_yaml: str) -> None:
    """A resume trains on the checkpoint's folders (files added to them are new data of the
    same run); other folders are another run, which must not continue this one's weights."""
    old, new = dataset_folders(saved_yaml), dataset_folders(current_yaml)
    if len(old) == len(new) and all(_same_folder(a, b) for a, b in zip(old, new)):
        return
    name = OmegaConf.create(current_yaml).get("name") or "run"
    suggested = f"{name}-{Path(new[0]).name}" if new else f"{name}-2"
    raise ConfigError(
        f"cannot resume {run_dir} from its checkpoint {path.name} (step {step}): it trained on "
        f"another dataset.\n  dataset folders in the checkpoint: {', '.join(old) or '(none)'}\n"
        f"  dataset folders now: {', '.join(new) or '(none)'}\n"
        f"A different dataset is a new run: give it another name, e.g. `name={suggested}` (or "
        "`hydra.run.dir=...`); or `train.resume=false` to train from scratch in this run dir. "
        "(Files added to the same folders are fine: such a run resumes.)"
    )


def finished_run(run_dir: Path, max_steps: int, export_dir: Path) -> int | None:
    """The step of a run with nothing left to do (None if it has): its newest complete
    checkpoint is at `max_steps` or later, and `export_dir` (`<run>/lora` or `<run>/model`)
    holds the final export written after that checkpoint (an export from an earlier, shorter
    run does not count, nor a folder of step exports only)."""
    newest = newest_complete(run_dir)
    if newest is None or newest[0] < max_steps or not export_dir.is_dir():
        return None
    step, path = newest
    final_export = [p for p in export_dir.iterdir() if not p.name.startswith(PREFIX)]
    if not final_export or export_dir.stat().st_mtime < (path / MARKER).stat().st_mtime:
        return None
    return step


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
