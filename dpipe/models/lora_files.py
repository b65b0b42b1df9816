"""A LoRA in diffusers' format, which every family writes.

A trained LoRA leaves the pipeline as peft's state dict of the denoiser. Each family writes it
through its pipeline's `save_lora_weights`, so that `pipeline.load_lora_weights` reads it, and then
in its ComfyUI (or kohya) form, whose names are the family's own (`dpipe.models.comfyui`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dpipe.io import atomic_write_text

log = logging.getLogger(__name__)

DIFFUSERS_LORA = "pytorch_lora_weights.safetensors"  # the name save_lora_weights gives its file
EXPORTS_RECORD = "exports.json"  # which format files an export wrote, and what each left out


def save_diffusers_lora(loader, weights: dict[str, torch.Tensor], metadata: dict[str, Any],
                        out_dir: Path, component: str = "transformer") -> Path:
    """Writes diffusers-named `weights` with their adapter `metadata` through `loader` (a pipeline
    class or its LoRA loader mixin) as the LoRA of `component`; returns the file."""
    loader.save_lora_weights(out_dir, **{f"{component}_lora_layers": weights,
                                         f"{component}_lora_adapter_metadata": metadata})
    return out_dir / DIFFUSERS_LORA


def lora_metadata(cfg, default_targets) -> dict[str, Any]:
    """peft's adapter config as diffusers stores it: rank, alpha (the rank when unset), targets."""
    rank = cfg.lora.rank
    return {
        "r": rank,
        "lora_alpha": cfg.lora.alpha if cfg.lora.alpha is not None else rank,
        "target_modules": cfg.lora.targets or default_targets,
    }


def lora_scale(metadata: dict[str, Any]) -> float:
    """alpha / rank: the factor peft applies to B @ A, which formats without an alpha fold into B."""
    return metadata["lora_alpha"] / metadata["r"]


def peft_to_diffusers(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft names carry the adapter name ("lora_A.default.weight"); diffusers' format does not."""
    return {k.replace(".default.", "."): v.contiguous() for k, v in state_dict.items()}


class NotInFormat(ValueError):
    """A format has no name for some LoRA modules (its original checkpoint has no such weight):
    `partial` holds the file's tensors for every other module, `modules` the ones left out."""

    def __init__(self, what: str, modules: list[str], partial: dict[str, torch.Tensor]):
        self.modules, self.partial = sorted(modules), partial
        super().__init__(f"no {what} name for the LoRA on {few(self.modules)}")


def few(names: list[str], shown: int = 5) -> str:
    """The first `shown` names and how many there are in all."""
    more = f" ... ({len(names)} in all)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


@dataclass(frozen=True)
class LoraFormat:
    """A LoRA file besides the diffusers one: its name, its tensors (`build()`, which raises
    NotInFormat for modules the format cannot hold) and its safetensors metadata."""

    file: str
    build: Callable[[], dict[str, torch.Tensor]]
    metadata: dict[str, str] | None = None


def write_lora_files(out_dir: Path, write_diffusers: Callable[[], Path],
                     formats: list[LoraFormat]) -> list[Path]:
    """The one way every family writes its LoRA files: the diffusers file first, and whatever
    goes wrong there is raised, since nothing loads a LoRA without it; then each other format on
    its own, so a format that cannot hold a module, or fails, costs none of the others. The
    former leaves those modules out, the latter is not written; each warns once, and
    `exports.json` records what every format holds. Returns the files written, the diffusers
    file first. Errors of the disk itself (OSError) are raised: no other file would fare better.
    """
    from safetensors.torch import save_file

    diffusers_file = write_diffusers()
    written = [diffusers_file]
    record: dict[str, dict[str, Any]] = {diffusers_file.name: {"written": True, "left_out": []}}
    for fmt in formats:
        path = out_dir / fmt.file
        try:
            tensors, left_out = fmt.build(), []
        except NotInFormat as err:
            tensors, left_out = err.partial, err.modules
        except OSError:
            raise
        except Exception as err:  # a bug or an unmapped layout in one format: keep the others
            log.warning("%s not written: %s: %s", fmt.file, type(err).__name__, err)
            record[fmt.file] = {"written": False, "error": f"{type(err).__name__}: {err}"}
            continue
        if left_out:
            log.warning("%s leaves out the LoRA on %d module(s) that its format has no weight "
                        "for: %s; %s holds them", fmt.file, len(left_out), few(left_out),
                        diffusers_file.name)
        if not tensors:
            record[fmt.file] = {"written": False, "left_out": left_out,
                                "error": "no trained module has a name in this format"}
            continue
        tmp = path.with_name(f".{path.name}.tmp")
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=fmt.metadata)
        os.replace(tmp, path)
        record[fmt.file] = {"written": True, "left_out": left_out}
        written.append(path)
    atomic_write_text(out_dir / EXPORTS_RECORD, json.dumps({"formats": record}, indent=2) + "\n")
    return written


def export_gaps(out_dir: Path) -> str | None:
    """One line naming the format files of `out_dir`'s exports.json that were not written or
    leave modules out, or None when every format holds every trained module."""
    path = out_dir / EXPORTS_RECORD
    if not path.is_file():
        return None
    gaps = []
    for name, held in json.loads(path.read_text())["formats"].items():
        if not held.get("written"):
            gaps.append(f"{name} not written ({held.get('error', 'no reason recorded')})")
        elif held.get("left_out"):
            gaps.append(f"{name} leaves out {len(held['left_out'])} module(s)")
    if not gaps:
        return None
    return f"LoRA export {out_dir}: {'; '.join(gaps)}; see {path} (the diffusers file holds all)"
