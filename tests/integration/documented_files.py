"""The files the documented commands assume a user has, made here on tiny models.

docs/lora-files.md's `dpipe-lora` lines and `model.lora.init_from` take a kohya LoRA, a second
LoRA, FLUX.1-dev as a diffusers folder and as a single file, and a full fine-tune's export; the
edit pages a folder with two references per image. tests/integration/test_documented_commands.py
maps each documented path to one of these (its MAPPING["paths"]).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.exports import adapted, adapter_state, comfyui_as_kohya, export_lora
from tests.unit.test_data_support import write_image

LORA_RANK = 16  # docs/lora-files.md's `model.lora.init_from=... model.lora.rank=16`


def write_edits(folder: Path) -> Path:
    """An edit dataset as docs/models/flux2.md and qwen_image_edit_plus.md show it: each image
    with two references in control/ (`a_1.png`, `a_2.png`); four, as a step of the default
    pipeline takes four micro-batches of one."""
    for i, stem in enumerate(("a", "b", "c", "d")):
        write_image(folder / f"{stem}.png", (64, 64), seed=40 + i,
                    caption="the person wearing the jacket")
        for k in (1, 2):
            write_image(folder / "control" / f"{stem}_{k}.png", (64, 64), seed=50 + 2 * i + k,
                        caption=None)
    return folder


def write_flux_files(models: Path, loras: Path, full_run: Path) -> None:
    """FLUX.1-dev (tiny) as `models/FLUX.1-dev`, `models/flux1-dev.safetensors` and as ComfyUI's
    scaled fp8 file `models/flux1-dev-fp8_scaled.safetensors`; a LoRA of
    rank 16 in kohya's names (`loras/style_kohya.safetensors`) and one in diffusers' names
    (`loras/detail.safetensors`); a full fine-tune's export (`full_run/model`)."""
    from dpipe.models.common.quantized_files import write_quantized_copy
    from dpipe.models.flux.tiny import make_tiny_flux, write_bfl_single_file

    folder = make_tiny_flux(models / "FLUX.1-dev")
    plain = write_bfl_single_file(folder, models / "flux1-dev.safetensors",
                                  prefix="model.diffusion_model.")
    write_quantized_copy(plain, models / "flux1-dev-fp8_scaled.safetensors", torch.float8_e4m3fn)
    loras.mkdir(parents=True, exist_ok=True)
    written = _trained_lora_files(folder, loras / "exported", seed=0)
    save_file(comfyui_as_kohya(load_file(written["flux_lora_comfyui.safetensors"])),
              loras / "style_kohya.safetensors")
    detail = _trained_lora_files(folder, loras / "exported_detail", seed=1)
    shutil.copy(detail["pytorch_lora_weights.safetensors"], loras / "detail.safetensors")
    _write_fine_tune(folder / "transformer", full_run / "model")


def _trained_lora_files(folder: Path, out: Path, seed: int) -> dict[str, Path]:
    """The files a LoRA run of FLUX.1 (tiny, rank 16) exports, its adapter moved off zero as
    training moves it; {file name: path}."""
    from dpipe.config.compose import compose_run
    from dpipe.models.registry import build_spec

    run = compose_run(["model=tiny_flux", f"model.path={folder}", f"model.lora.rank={LORA_RANK}",
                       f"model.lora.alpha={LORA_RANK}", "dataset=synthetic"])
    spec = build_spec(run.model)
    state = adapter_state(adapted(spec.load_denoiser(torch.float32), run, spec, seed=seed))
    return {p.name: p for p in export_lora(spec, state, out)}


def _write_fine_tune(transformer: Path, model: Path) -> None:
    """A full run's `model/` export (a diffusers transformer folder) whose matrices moved from
    the base's by a rank-2 change, as a short fine-tune moves them."""
    model.mkdir(parents=True, exist_ok=True)
    shutil.copy(transformer / "config.json", model / "config.json")
    generator = torch.Generator().manual_seed(2)
    for file in sorted(transformer.glob("*.safetensors")):
        tensors = load_file(file)
        for key, value in tensors.items():
            if value.ndim == 2 and min(value.shape) > 2:
                change = (torch.randn(value.shape[0], 2, generator=generator)
                          @ torch.randn(2, value.shape[1], generator=generator))
                tensors[key] = (value.float() + 0.01 * change).to(value.dtype)
        save_file(tensors, model / file.name)
    for index in transformer.glob("*.index.json"):
        shutil.copy(index, model / index.name)
