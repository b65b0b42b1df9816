"""Exports the trained weights, merged from every pipeline stage, in the family's formats.

Each stage writes the weights of its own layers (under the denoiser's names) to a shard; rank 0
then hands the shards to the model spec. No rank ever holds the whole model for a full export.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import load_file, save_file

from dpipe.io import replace_dir
from dpipe.models.adapters import adapter_metadata
from dpipe.models.lora_files import export_gaps
from dpipe.models.spec import ModelSpec, PipelineLayer
from dpipe.train.shared_write import write_together

log = logging.getLogger(__name__)

STEP_PREFIX = "step_"
EMA_DIR = "ema"  # the EMA's export inside each export folder (train.ema.decay > 0)


def export_dir(run_dir: Path, lora: bool, step: int | None = None) -> Path:
    """`<run>/lora/` (`<run>/model/` for a full fine-tune), or its `step_<N>/` export."""
    top = run_dir / ("lora" if lora else "model")
    return top if step is None else top / f"{STEP_PREFIX}{step}"


def export(
    local_layers: list[PipelineLayer], spec: ModelSpec, lora: bool, run_dir: Path,
    stage: int, stages: int, dp_rank: int, step: int | None = None, keep: int = 0,
    ema=None,
) -> Path | None:
    """Collective: every rank calls it. Returns the export folder on rank 0.

    `step=None`: the final export, `<run>/lora/` (`<run>/model/` for a full fine-tune); the
    `step_<N>/` exports inside it carry over. `step=N`: an intermediate export to
    `<run>/lora/step_<N>/`, after which only the newest `keep` of those stay (0: all). Either
    is written whole beside its place, then renamed into it; a re-run step rewrites its folder.
    `ema` (a dpipe.train.ema.WeightAverage, on every rank or on none): its average is exported
    too, in the same formats, to the folder's `ema/`, renamed into place with it.
    """
    top, out_dir = export_dir(run_dir, lora), export_dir(run_dir, lora, step)
    # Temporary folders beside `top`, named for the destination: a step export's never meets
    # the final export's, and no half-written one ever looks like a step export.
    name = top.name if step is None else f"{top.name}.{out_dir.name}"
    tmp, final_tmp = run_dir / f".{name}.partial", run_dir / f".{name}.new"

    def together(write, needed: int) -> None:  # a full disk on any rank fails every rank
        write_together(write, "the export", out_dir, needed, [tmp, final_tmp],
                       lambda rank: _what_is_left(run_dir, rank))

    together(lambda: _fresh(tmp) if dist.get_rank() == 0 else None, 0)
    shard_bytes = _trainable_bytes(local_layers, lora) if dp_rank == 0 else 0
    # Data-parallel replicas hold identical weights: one replica of each stage writes its shard.
    together(lambda: _write_shards(local_layers, lora, tmp, stage, ema) if dp_rank == 0 else None,
             shard_bytes * (2 if ema is not None else 1))
    shards = [tmp / f"stage-{s:03d}.safetensors" for s in range(stages)]
    ema_shards = ([tmp / f"ema-stage-{s:03d}.safetensors" for s in range(stages)]
                  if ema is not None else [])
    # Rank 0 writes every format from the shards: about twice their bytes (ComfyUI's copy, or a
    # single file beside the diffusers folder).
    needed = (2 * sum(s.stat().st_size for s in shards + ema_shards)
              if dist.get_rank() == 0 else 0)
    together(lambda: write_formats(spec, lora, shards, ema_shards, tmp, final_tmp, top, out_dir,
                                    step, keep) if dist.get_rank() == 0 else None, needed)
    return out_dir if dist.get_rank() == 0 else None


def _write_shards(local_layers: list[PipelineLayer], lora: bool, tmp: Path, stage: int,
                  ema) -> None:
    write_stage_shard(local_layers, lora, tmp / f"stage-{stage:03d}.safetensors")
    if ema is not None:
        with ema.swapped_in():
            write_stage_shard(local_layers, lora, tmp / f"ema-stage-{stage:03d}.safetensors")


def _fresh(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)


def _trainable_bytes(local_layers: list[PipelineLayer], lora: bool) -> int:
    return sum(p.numel() * p.element_size() for layer in local_layers
               for p in layer.parameters() if p.requires_grad or not lora)


def write_formats(spec: ModelSpec, lora: bool, shards: list[Path], ema_shards: list[Path],
                   tmp: Path, final_tmp: Path, top: Path, out_dir: Path, step: int | None,
                   keep: int) -> None:
    """Rank 0: the family's files from the stage shards (and the EMA's into `ema/`), written
    beside `out_dir`, then renamed into it (the final export takes the step exports along)."""
    _fresh(final_tmp)
    _write_family_files(spec, lora, shards, final_tmp)
    if ema_shards:
        (final_tmp / EMA_DIR).mkdir()
        _write_family_files(spec, lora, ema_shards, final_tmp / EMA_DIR)
    shutil.rmtree(tmp)
    if step is None:
        _carry_step_exports(top, final_tmp)
    else:
        top.mkdir(parents=True, exist_ok=True)
    replace_dir(final_tmp, out_dir)
    if step is not None:
        prune_step_exports(top, keep)


def _write_family_files(spec: ModelSpec, lora: bool, shards: list[Path], folder: Path) -> None:
    if lora:
        merged = {}
        for shard in shards:
            merged.update(load_file(shard))
        spec.export_lora(merged, adapter_metadata(spec.cfg, spec.lora_targets()), folder)
        gaps = export_gaps(folder)
        if gaps:  # one line at the end of the export, whatever the formats warned on the way
            log.warning(gaps)
    else:
        spec.export_full(shards, folder)


def _what_is_left(run_dir: Path, rank: int) -> str:
    from dpipe.train.checkpoint import newest_complete

    newest = newest_complete(run_dir)
    kept = (f"the newest complete checkpoint is {newest[1]} (step {newest[0]}): the same command "
            "resumes from it and writes the export once there is space" if newest else
            "there is no checkpoint to write it from")
    return f"The partial export was removed (rank {rank} failed to write it); {kept}."


def step_exports(top: Path) -> list[Path]:
    """The `step_<N>/` exports in `top` (`<run>/lora` or `<run>/model`), oldest first."""
    if not top.is_dir():
        return []
    found = [p for p in top.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)
             and p.name[len(STEP_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))


def prune_step_exports(top: Path, keep: int) -> None:
    """Keeps the newest `keep` step exports in `top` (0: all)."""
    if keep > 0:
        for old in step_exports(top)[:-keep]:
            shutil.rmtree(old)


def _carry_step_exports(top: Path, new_top: Path) -> None:
    """Puts `top`'s step exports into the final export about to replace it, as hard links
    (their files are never written again in place), copies where the file system has none.
    The old `top` stays whole until the rename, so a kill at any point loses none of them."""
    for folder in step_exports(top):
        try:
            shutil.copytree(folder, new_top / folder.name, copy_function=os.link)
        except OSError:
            shutil.rmtree(new_top / folder.name, ignore_errors=True)
            shutil.copytree(folder, new_top / folder.name)


def write_stage_shard(local_layers: list[PipelineLayer], lora: bool, path: Path) -> None:
    """One stage's weights under the denoiser's names: LoRA weights only, or everything."""
    weights = {}
    for layer in local_layers:
        weights.update(layer.denoiser_state_dict(trainable_only=lora))
    save_file({k: v.contiguous().cpu() for k, v in weights.items()}, path)
