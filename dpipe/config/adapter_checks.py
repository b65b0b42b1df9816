"""Checks of model.adapter and model.lokr_factor against the rest of the config (the adapter files
that model.lora.init_from and model.merge_adapters name: dpipe.launch.prestart)."""

from __future__ import annotations

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
                 else f"model.base_compute={m.base_compute.value}"
                 if m.base_compute != BaseCompute.auto else None)
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
