"""A run's checkpoint written again in the family's formats (`dpipe-export`), in one process.

Each checkpoint layer file names the diffusers parameter behind each of its tensors (its
`EXPORT_NAMES` metadata), so the weights go to the family's writers (`spec.export_lora`,
`spec.export_full`) without building the model or starting any worker: an export that failed
or was lost, or a format added since, is written from the checkpoint the run kept.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from dpipe.config.schema import TrainMode
from dpipe.errors import UserError
from dpipe.pipeline.layer_files import EXPORT_NAMES, layer_file
from dpipe.train import checkpoint
from dpipe.train.ema import file_name as ema_file_name
from dpipe.train.export import export_dir, write_formats

log = logging.getLogger("dpipe")
LAYER_FILE = re.compile(r"layer_(\d+)-model_states\.safetensors")


def reexport(run_dir: Path, checkpoint_name: str | None = None) -> Path:
    """Writes the export of `run_dir`'s checkpoint `checkpoint_name` (`step_<N>` or its folder
    name; None: the newest that verifies) and returns its folder: the final export
    (`<run>/lora/`, `<run>/model/`) for a checkpoint at `train.max_steps`, else the step's
    (`<run>/lora/step_<N>/`). Other exports stay as they are."""
    from omegaconf import OmegaConf

    from dpipe.config.checks import validate
    from dpipe.config.run_name import RUN_CONFIG
    from dpipe.models.registry import build_spec

    if not (run_dir / RUN_CONFIG).is_file():
        raise UserError(f"run={run_dir} holds no run (no {RUN_CONFIG}): give a run dir that "
                        "dpipe-train made, e.g. outputs/<name>")
    run = validate(OmegaConf.load(run_dir / RUN_CONFIG))  # any process count: none starts
    step, path = _checkpoint(run_dir, checkpoint_name)
    spec = build_spec(run.model)
    lora = run.model.mode == TrainMode.lora
    final = step >= run.train.max_steps
    top, out_dir = export_dir(run_dir, lora), export_dir(run_dir, lora, None if final else step)
    name = top.name if final else f"{top.name}.{out_dir.name}"
    tmp, final_tmp = run_dir / f".{name}.partial", run_dir / f".{name}.new"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        names = {}
        shards = []
        for index, layer_path in _layer_files(path):
            names[index] = _export_names(layer_path)
            shard = tmp / f"layer-{index:03d}.safetensors"
            _write_renamed(layer_path, names[index], shard)
            shards.append(shard)
        ema_shards = []
        for stage in range(run.pipeline.stages):
            ema_path = path / ema_file_name(stage)
            if ema_path.is_file():  # keys "<layer index>.<name in the layer>"
                shard = tmp / f"ema-{stage:03d}.safetensors"
                _write_ema(ema_path, names, shard)
                ema_shards.append(shard)
        write_formats(spec, lora, shards, ema_shards, tmp, final_tmp, top, out_dir,
                      None if final else step, keep=0)
    except BaseException as error:  # nothing half-written stays beside the exports
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final_tmp, ignore_errors=True)
        if isinstance(error, OSError):
            raise UserError(f"cannot write the export {out_dir}: {error}; nothing was replaced. "
                            "Free space there (or fix its permissions) and run the same "
                            "command again") from None
        raise
    log.info("exported %s from checkpoint %s (step %d)", out_dir, path.name, step)
    return out_dir


def _checkpoint(run_dir: Path, name: str | None) -> tuple[int, Path]:
    complete = checkpoint.complete_checkpoints(run_dir)
    if name is None:
        newest = checkpoint.newest_verified(run_dir, using="exporting from")
        if newest is None:
            raise UserError(f"run {run_dir} has no complete checkpoint to export from")
        return newest
    usable = ", ".join(p.name for _, p in complete if checkpoint.problem(p) is None) or "none"
    asked = re.fullmatch(r"(?:step_)?(\d+)", name)
    if asked is None:
        raise UserError(f"checkpoint={name}: give a step, as step_<N> or <N> (the checkpoints "
                        f"that verify: {usable})")
    for step, path in complete:
        if step == int(asked.group(1)):
            wrong = checkpoint.problem(path)
            if wrong is not None:
                raise UserError(f"checkpoint {path} is damaged: {wrong}; choose another (the "
                                f"checkpoints that verify: {usable})")
            return step, path
    raise UserError(f"checkpoint={name}: run {run_dir} has no such complete checkpoint; the "
                    f"checkpoints that verify: {usable}")


def _layer_files(path: Path) -> list[tuple[int, Path]]:
    found = [(int(m.group(1)), p) for p in path.iterdir()
             if (m := LAYER_FILE.fullmatch(p.name))]
    if not found:
        raise UserError(f"checkpoint {path} holds no safetensors layer files (it was written by "
                        "a dpipe before 2026-12-04): resume the run with dpipe-train to write "
                        "its export")
    gaps = sorted(set(range(max(i for i, _ in found) + 1)) - {i for i, _ in found})
    if gaps:  # an export without those layers' tensors would be written, and look whole
        missing = ", ".join(layer_file(path, i).name for i in gaps)
        raise UserError(f"checkpoint {path} lacks the layer files {missing}: nothing exported; "
                        "choose another checkpoint (checkpoint=step_<N>)")
    return sorted(found)


def _export_names(layer_path: Path) -> dict[str, str]:
    with safe_open(layer_path, framework="pt") as f:
        names = (f.metadata() or {}).get(EXPORT_NAMES)
    if names is None:
        raise UserError(f"{layer_path} does not name its tensors' diffusers parameters (it was "
                        "written by an older dpipe): resume the run with dpipe-train, whose "
                        "next checkpoint and export will have them")
    return json.loads(names)


def _write_renamed(source: Path, names: dict[str, str], out: Path) -> None:
    """The tensors of `source` that `names` maps, under their diffusers names; buffers, which
    exports leave out, have none."""
    with safe_open(source, framework="pt") as f:
        tensors = {names[k]: f.get_tensor(k) for k in f.keys() if k in names}
    save_file(tensors, out)


def _write_ema(ema_path: Path, names: dict[int, dict[str, str]], out: Path) -> None:
    with safe_open(ema_path, framework="pt") as f:
        tensors = {}
        for key in f.keys():
            index, _, local = key.partition(".")
            source = names.get(int(index), {}).get(local)
            if source is None:
                raise UserError(f"{ema_path}: its tensor {key} belongs to no layer file of the "
                                "checkpoint; the checkpoint is incomplete")
            tensors[source] = f.get_tensor(key)
    save_file(tensors, out)
