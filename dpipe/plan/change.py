"""For a run that does not fit: the smallest change that would, with the plan it gives.

Tried in order, from what costs the user least to what costs most: the planner's own choices
where the user fixed them (fp8 base weights, but for a quantized file's base; recompute and
block swap "auto"), a lower resolution, more GPUs of the same kind, more host memory.
"""

from __future__ import annotations

from dataclasses import replace

from dpipe.config.schema import TrainMode
from dpipe.plan.choose import Plan, base_storage, choose
from dpipe.plan.footprint import ModelFootprint
from dpipe.plan.machine import GiB, Machine, size


def _lower(footprint: ModelFootprint, factor: float) -> ModelFootprint:
    """The footprint at `factor` times the tokens: activations, FLOPs and latents scale with
    them (attention's FLOPs faster, which this undercounts: it only speeds a lower resolution)."""
    layers = tuple(replace(x, activations=int(x.activations * factor), flops=x.flops * factor)
                   for x in footprint.layers)
    return replace(footprint, layers=layers, tokens=int(footprint.tokens * factor),
                   latent_bytes=int(footprint.latent_bytes * factor))


def smallest_change(footprint: ModelFootprint, run, machine: Machine, fixed: set[str],
                    resolution: int, **kw) -> tuple[str, Plan] | None:
    """(the change, in words with the keys to type, and the plan it gives), or None if none of
    those tried fits."""
    tries = []
    need = choose(footprint, run, machine, fixed, **kw).disk
    if need is not None and machine.disk_gib is not None and need > machine.disk_gib * GiB:
        tries.append((f"{size(need)} free on the cache disk (this one: "
                      f"{size(int(machine.disk_gib * GiB))}; or dataset.cache_dir on another "
                      "disk)", footprint, replace(machine, disk_gib=need / GiB), fixed))
    # Not for a quantized file's base (a GGUF's blocks, a file's 8-bit Linears): its storage is
    # the file's, whatever model.base_dtype says.
    if run.model.mode == TrainMode.lora and "model.base_dtype" in fixed \
            and not run.model.base_dtype.quantized and not base_storage(run, False).from_file:
        tries.append(("model.base_dtype=fp8 (8-bit frozen base weights)",
                      footprint, machine, fixed - {"model.base_dtype"}))
    freed = fixed - {"pipeline.activation_checkpointing", "pipeline.blocks_to_swap",
                     "pipeline.memory_budget_gb"}
    if freed != fixed:
        tries.append(("pipeline.activation_checkpointing=auto pipeline.blocks_to_swap=auto "
                      "(recompute and block swap as the budget needs)", footprint, machine, freed))
    for side in (resolution * 3 // 4, resolution // 2):
        side -= side % 64
        if side >= 256:
            tries.append((f"dataset.resolutions=[{side}] (from {resolution})",
                          _lower(footprint, (side / resolution) ** 2), machine, fixed))
    for gpus in (2, 4, 8):
        if gpus > machine.gpus:
            tries.append((f"{gpus} GPUs of {machine.gpu_gib:g} GiB free (this machine: "
                          f"{machine.gpus})", footprint, machine.with_gpus(gpus), fixed))
    for host in (32, 64, 128, 256, 512):
        if host > machine.host_gib:
            tries.append((f"{host} GiB of host memory (this machine: {machine.host_gib:g})",
                          footprint, replace(machine, host_gib=host), fixed))
    for words, fp, m, keys in tries:
        plan = choose(fp, run, m, keys, **kw)
        if plan.fits:
            return words, plan
    return None


def gib(n: int) -> str:
    return f"{n / GiB:.1f}"

