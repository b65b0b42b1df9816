"""Checks of model.adapter, model.lokr_factor, model.lora.init_from and model.merge_adapters."""

from __future__ import annotations

from pathlib import Path

from dpipe.config.schema import Adapter, BaseCompute, RunConfig, TrainMode
from dpipe.errors import ConfigError


def check_adapter(run: RunConfig) -> None:
    """The combinations that cannot train, refused from the config alone."""
    m = run.model
    if m.mode == TrainMode.full and m.adapter != Adapter.lora:
        raise ConfigError(
            f"model.adapter={m.adapter.value} adds an adapter, but model.mode=full trains every "
            "weight itself: use model.mode=lora with it, or drop model.adapter")
    if m.mode == TrainMode.full and m.lora.init_from:
        raise ConfigError(
            "model.lora.init_from starts an adapter from a file, but model.mode=full trains no "
            "adapter: use model.mode=lora, or merge the file into the base with "
            "'model.merge_adapters=[<file>]'")
    eight_bit = (f"model.base_dtype={m.base_dtype.value}" if m.base_dtype.quantized
                 else "model.base_compute=fp8" if m.base_compute == BaseCompute.fp8 else None)
    if m.adapter == Adapter.dora and eight_bit:
        raise ConfigError(
            "model.adapter=dora normalises each row of the adapted base weight, which "
            f"{eight_bit} stores scaled per row (DoRA would read the scaled values): drop "
            f"{eight_bit.split('=')[0]} with DoRA, or use model.adapter=lora|lokr|loha with it")
    if m.lokr_factor != -1 and m.adapter != Adapter.lokr:
        raise ConfigError(
            f"model.lokr_factor={m.lokr_factor} applies to model.adapter=lokr only "
            f"(this run trains {m.adapter.value}): set model.adapter=lokr, or drop it")
    if m.lokr_factor == 0 or m.lokr_factor < -1:
        raise ConfigError(f"model.lokr_factor must be -1 (as square as it divides) or >= 1, got "
                          f"{m.lokr_factor}")


def check_adapter_files(run: RunConfig, spec) -> None:
    """model.lora.init_from and model.merge_adapters name readable adapter files of a form this
    family reads, before any worker starts; their keys and shapes are checked against the
    model on every stage (dpipe.train.adapter_init)."""
    from dpipe.models.adapters import adapter_kind
    from dpipe.train.adapter_init import read_adapter_file

    m = run.model
    if m.lora.init_from:
        _, _, keys, _ = read_adapter_file(m.lora.init_from, "model.lora.init_from", spec)
        kind = adapter_kind(keys)
        if kind != m.adapter:
            raise ConfigError(
                f"model.lora.init_from={m.lora.init_from} holds a {kind.value} adapter, but this "
                f"run trains model.adapter={m.adapter.value}: set model.adapter={kind.value}, or "
                f"give a {m.adapter.value} file")
    for i, file in enumerate(m.merge_adapters):
        read_adapter_file(file, f"model.merge_adapters[{i}]", spec)


def adapter_file_path(file: str, key: str) -> Path:
    """The safetensors file `file` names (a folder: its pytorch_lora_weights.safetensors)."""
    from dpipe.models.lora_files import DIFFUSERS_LORA

    path = Path(file).expanduser()
    if path.is_dir():
        path = path / DIFFUSERS_LORA
    if not path.is_file():
        raise ConfigError(f"{key}={file}: no such file (give a .safetensors LoRA file, or a "
                          f"folder holding {DIFFUSERS_LORA})")
    return path
