"""A family's exports as the trainer makes them, for tests that export without a run."""

from __future__ import annotations

from pathlib import Path

import torch

from dpipe.models.adapters import adapter_metadata
from dpipe.models.spec import ModelSpec


def export_lora(spec: ModelSpec, state_dict: dict[str, torch.Tensor], out_dir: Path) -> list[Path]:
    """`spec.export_lora` with the adapter metadata the trainer computes from model.lora."""
    return spec.export_lora(state_dict, adapter_metadata(spec.cfg, spec.lora_targets()), out_dir)
