"""Exports the trained weights, merged from every pipeline stage, in the family's formats.

Each stage writes the weights of its own layers (under the denoiser's names) to a shard; rank 0
then hands the shards to the model spec. No rank ever holds the whole model for a full export.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import load_file, save_file

from dpipe.io import atomic_write_text, replace_dir
from dpipe.models.single_file import export_like_source
from dpipe.models.spec import ModelSpec, PipelineLayer


def export(
    local_layers: list[PipelineLayer], spec: ModelSpec, lora: bool, run_dir: Path,
    stage: int, stages: int, dp_rank: int,
) -> Path | None:
    """Collective: every rank calls it. Returns the export folder on rank 0."""
    out_dir = run_dir / ("lora" if lora else "model")
    tmp = run_dir / f".{out_dir.name}.partial"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    if dp_rank == 0:  # data-parallel replicas hold identical weights
        write_stage_shard(local_layers, lora, tmp / f"stage-{stage:03d}.safetensors")
    dist.barrier()
    if dist.get_rank() != 0:
        dist.barrier()
        return None
    shards = [tmp / f"stage-{s:03d}.safetensors" for s in range(stages)]
    final_tmp = run_dir / f".{out_dir.name}.new"
    shutil.rmtree(final_tmp, ignore_errors=True)
    final_tmp.mkdir()
    if lora:
        merged = {}
        for shard in shards:
            merged.update(load_file(shard))
        spec.export_lora(merged, final_tmp)
    else:
        spec.export_full(shards, final_tmp)
    shutil.rmtree(tmp)
    replace_dir(final_tmp, out_dir)
    dist.barrier()
    return out_dir


def write_stage_shard(local_layers: list[PipelineLayer], lora: bool, path: Path) -> None:
    """One stage's weights under the denoiser's names: LoRA weights only, or everything."""
    weights = {}
    for layer in local_layers:
        weights.update(layer.denoiser_state_dict(trainable_only=lora))
    save_file({k: v.contiguous().cpu() for k, v in weights.items()}, path)


def write_sharded_diffusers_model(shards: list[Path], out_dir: Path, config_path: Path) -> Path:
    """Per-stage shards -> a diffusers model folder (`from_pretrained` reads it as is)."""
    out_dir.mkdir(parents=True)
    shutil.copyfile(config_path, out_dir / "config.json")
    if len(shards) == 1:
        shutil.move(shards[0], out_dir / "diffusion_pytorch_model.safetensors")
        return out_dir
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = load_file(shard)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({key: name for key in tensors})
        shutil.move(shard, out_dir / name)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_text(out_dir / "diffusion_pytorch_model.safetensors.index.json",
                      json.dumps(index, indent=2))
    return out_dir


def write_transformer_folder(shards: list[Path], out_dir: Path, model_path: Path,
                             single_file: Path | None = None, to_original=None) -> Path:
    """A full fine-tune as `out_dir / "transformer"`, a diffusers model folder with the base
    model's config; where the base came as one file, also laid out and named as that file, so the
    tools that loaded it load the fine-tune the same way (`to_original` maps diffusers names to
    the file's). Returns the folder."""
    folder = write_sharded_diffusers_model(shards, out_dir / "transformer",
                                           model_path / "transformer" / "config.json")
    if single_file is not None:
        export_like_source(folder, single_file, to_original, out_dir)
    return folder
