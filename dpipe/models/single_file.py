"""A full fine-tune written back in the layout of the single file it was trained from.

Users who trained from a single-file checkpoint (model.path=<file>) load the result where they
loaded the file (ComfyUI's model folders, the original repos' scripts), so the export writes one
more file, named as the source, beside the diffusers folder: every key of the source in its order,
prefix and dtype, each transformer weight replaced by the trained one, and what the source holds
besides the transformer (LTX-Video's VAE, NVIDIA's training buffers) copied unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from dpipe.errors import ModelLoadError

# Prefixes in front of the original names in the files users hold: ComfyUI's saves, NVIDIA's.
_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "net.")


def export_like_source(folder: Path, source: Path, to_original: Callable, out_dir: Path) -> Path:
    """Write the diffusers transformer in `folder` (its safetensors shards) as `out_dir /
    source.name`, laid out as `source`. `to_original` maps diffusers names to the original
    names without prefix. Returns the file written."""
    from diffusers.loaders.single_file_utils import load_single_file_checkpoint
    from safetensors.torch import load_file, save_file

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(shard))
    trained = to_original(weights)
    out, placed = {}, set()
    for key, value in load_single_file_checkpoint(str(source)).items():
        name = _unprefixed(key)
        if name in trained:
            out[key] = trained[name].to(value.dtype).contiguous()
            placed.add(name)
        else:
            out[key] = value
    left = sorted(set(trained) - placed)
    if left:
        raise ModelLoadError(f"{source} has no place for trained weights {left[:3]} "
                             f"({len(left)} in all): not the layout it was loaded from")
    path = out_dir / source.name
    if source.suffix == ".pt":
        torch.save(out, path)
    else:
        save_file(out, path, metadata={"format": "pt"})
    return path


def _unprefixed(key: str) -> str:
    for prefix in _PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):]
    return key
