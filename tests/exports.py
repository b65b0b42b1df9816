"""A family's exports as the trainer makes them, for tests that export without a run: a
trained-looking adapter, its state, an adapter read back by model.lora.init_from, and a
ComfyUI export renamed as other tools name their LoRAs."""

from __future__ import annotations

from pathlib import Path

import torch

from dpipe.models.adapters import adapter_metadata, is_adapter_param
from dpipe.models.spec import ModelSpec
from dpipe.train.adapter_init import init_adapter
from dpipe.train.lora import make_trainable


def export_lora(spec: ModelSpec, state_dict: dict[str, torch.Tensor], out_dir: Path) -> list[Path]:
    """`spec.export_lora` with the adapter metadata the trainer computes from model.lora."""
    return spec.export_lora(state_dict, adapter_metadata(spec.cfg, spec.lora_targets()), out_dir)


def comfyui_as_kohya(comfy: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ComfyUI-named LoRA as musubi-tuner and kohya's sd-scripts write theirs: `lora_unet_`
    and the module's name with dots as underscores, lora_down / lora_up, an `.alpha` each (here
    the rank: the ComfyUI file folds its scale into lora_up)."""
    out = {}
    for key, value in comfy.items():
        module, part = key.removeprefix("diffusion_model.").rsplit(".lora_", 1)
        name = "lora_unet_" + module.replace(".", "_")
        out[f"{name}.lora_{'down' if part.startswith('A') else 'up'}.weight"] = value
        if part.startswith("A"):
            out[f"{name}.alpha"] = torch.tensor(float(value.shape[0]))
    return out


def adapted(denoiser, run, spec, seed=None):
    """`denoiser` (in place) with the run's adapter, trained-looking with a `seed`."""
    make_trainable(denoiser, run.model, spec.lora_targets())
    if seed is not None:  # trained-looking: B starts at zero, which would hide a wrong scale
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in denoiser.named_parameters():
                if is_adapter_param(name):
                    param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return denoiser


def adapter_state(denoiser) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in denoiser.named_parameters() if is_adapter_param(n)}


def adapter_from_file(denoiser, run, spec, file) -> dict[str, torch.Tensor]:
    """`denoiser`'s adapter (NaN first, so no weight survives unread) from `file` by
    model.lora.init_from; its adapter state."""
    with torch.no_grad():
        for name, param in denoiser.named_parameters():
            if is_adapter_param(name):
                param.fill_(float("nan"))
    run.model.lora.init_from = str(file)
    init_adapter(denoiser, run.model, spec)
    return adapter_state(denoiser)
