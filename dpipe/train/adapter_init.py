"""Adapter files going into a run: `model.merge_adapters` (merged into the frozen base weights
before training) and `model.lora.init_from` (the trained adapter's starting weights).

Both read a LoRA, DoRA, LoKr or LoHa file in any format users share (dpipe.models.lora_read:
diffusers, peft, ComfyUI, kohya, ai-toolkit/musubi-tuner, LyCORIS), placed on the denoiser's
modules through the family's own writers' names. Every pipeline stage builds the whole denoiser
before it keeps its own layers (dpipe.train.trainable), so applying them to the denoiser there
gives each stage its own layers' share.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpipe.config.schema import Adapter, ModelConfig
from dpipe.errors import ConfigError
from dpipe.models.adapters import TUCKER_CORES, adapter_metadata, is_adapter_param, modules_of
from dpipe.models.lora_files import DIFFUSERS_LORA, peft_to_diffusers

log = logging.getLogger(__name__)


def check_adapter_file(file: str, key: str) -> tuple[Path, str, Adapter]:
    """(the file, its format, its adapter kind) of a readable LoRA file of a layout dpipe reads;
    anything else is refused, naming `key`, the keys and the formats read. Checked before any
    worker starts; whether its modules fit the family is checked on the model (`read_adapter`)."""
    from safetensors import safe_open

    from dpipe.models.lora_read import LoraLayoutError, detect_format

    path = adapter_file_path(file, key)
    try:
        with safe_open(str(path), "pt") as f:
            keys = list(f.keys())
    except Exception as err:  # not a safetensors file
        raise ConfigError(f"{key}={file}: not readable as safetensors ({err})") from None
    try:
        fmt, kind = detect_format(keys)
    except LoraLayoutError as err:
        raise ConfigError(f"{key}={file}: {err}") from None
    return path, fmt, kind


def read_adapter(file: str, key: str, spec, denoiser: nn.Module):
    """The file's adapter on `denoiser`'s modules (a LoraRead), or a ConfigError naming `key`
    and the modules that do not fit."""
    from dpipe.models.lora_names import layer_shapes, lora_names
    from dpipe.models.lora_read import LoraLayoutError, read_lora

    path, _, _ = check_adapter_file(file, key)
    try:
        read = read_lora(path, lora_names(spec, layer_shapes(denoiser)), spec.cfg.family)
    except LoraLayoutError as err:
        raise ConfigError(f"{key}={file}: {err}") from None
    if read.text_encoder:
        log.warning("%s=%s: its LoRA on %d text-encoder module(s) is left out (dpipe trains "
                    "the denoiser only)", key, file, len(read.text_encoder))
    log.info("%s=%s: read as a %s %s file, %d modules", key, file, read.format, read.kind.value,
             len(read.modules))
    return read


def merge_adapters(denoiser: nn.Module, files: list[str], spec) -> None:
    """Merges each file's adapter into `denoiser`'s weights, in order (W += its delta, as peft
    and ComfyUI merge it), leaving plain modules: the base the run trains on."""
    for i, file in enumerate(files):
        key = f"model.merge_adapters[{i}]"
        read = read_adapter(file, key, spec, denoiser)
        if read.kind == Adapter.dora:  # its delta needs the base weight: peft merges it
            _merge_through_peft(denoiser, read, f"merged{i}")
        else:
            with torch.no_grad():
                for module in read.modules:
                    weight = denoiser.get_submodule(module).weight
                    weight.add_(read.delta(module, weight.shape).to(weight.dtype))
        log.info("merged %s into the base weights", file)


def _merge_through_peft(denoiser: nn.Module, read, name: str) -> None:
    from peft.tuners.tuners_utils import BaseTunerLayer

    from dpipe.models.adapters import load_adapter_tensors

    load_adapter_tensors(denoiser, read.tensors(), read.kind, adapter_name=name)
    for module_name, module in list(denoiser.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge(adapter_names=[name])
            parent_name, _, child = module_name.rpartition(".")
            parent = denoiser.get_submodule(parent_name) if parent_name else denoiser
            setattr(parent, child, module.get_base_layer())
    if hasattr(denoiser, "peft_config"):
        del denoiser.peft_config


def init_adapter(denoiser: nn.Module, cfg: ModelConfig, spec) -> None:
    """Loads model.lora.init_from into the adapter `make_trainable` put on `denoiser`: every
    adapter weight of the model from the file, shapes equal, each module's delta the file's
    (its scale refolded to this run's alpha / rank)."""
    file, key = cfg.lora.init_from, "model.lora.init_from"
    read = read_adapter(file, key, spec, denoiser)
    cored = sorted(m for m, parts in read.modules.items() if set(parts) & set(TUCKER_CORES))
    if cored:
        raise ConfigError(
            f"{key}={file}: {len(cored)} module(s) hold a LyCORIS Tucker core (lora_mid, "
            f"hada_t1/t2, lokr_t2), e.g. {cored[0]}: the adapters dpipe trains (peft's) have no "
            "such core, so the file cannot be continued; merge it into the base with "
            "model.merge_adapters instead")
    if read.kind != Adapter(cfg.adapter):
        raise ConfigError(f"{key}={file} holds a {read.kind.value} adapter, but this run trains "
                          f"model.adapter={Adapter(cfg.adapter).value}: set "
                          f"model.adapter={read.kind.value}, or give a {cfg.adapter.value} file")
    ours = adapter_metadata(cfg, spec.lora_targets())
    for name in ("r", "decompose_factor"):
        if name in read.config and name in ours and read.config[name] != ours[name]:
            setting = {"r": "model.lora.rank", "decompose_factor": "model.lokr_factor"}[name]
            raise ConfigError(f"{key}={file} was trained with {name}={read.config[name]}, this "
                              f"run has {setting}={ours[name]}: set {setting}="
                              f"{read.config[name]}")
    scale = ours.get("lora_alpha", ours.get("alpha")) / ours["r"]
    rescaled = sorted({s for s in read.scales.values() if s != scale})
    if rescaled:
        log.info("%s=%s: applied at scale %s in the file, refolded to this run's alpha / rank "
                 "= %s", key, file, rescaled, scale)
    tensors = read.tensors(scale)
    params = {diffusers_name(n): p for n, p in denoiser.named_parameters() if is_adapter_param(n)}
    check_fit(file, key, params, tensors)
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name].to(param.dtype))


def diffusers_name(peft_name: str) -> str:
    """A peft parameter name as diffusers' files name it ("...lora_A.default.weight" ->
    "...lora_A.weight")."""
    return next(iter(peft_to_diffusers({peft_name: torch.empty(0)})))


def check_fit(file: str, key: str, params: dict[str, Any], tensors: dict[str, torch.Tensor]):
    """The file's adapter modules are the model's, each tensor of the model's shape; else the
    first mismatch, named: module, tensor, expected and found."""
    ours, theirs = modules_of(params), modules_of(tensors)
    missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if missing or extra:
        what = []
        if missing:
            what.append(f"no weights for {len(missing)} adapted module(s) of this run, e.g. "
                        f"{missing[0]}")
        if extra:
            what.append(f"{len(extra)} module(s) this run does not adapt, e.g. {extra[0]}")
        raise ConfigError(f"{key}={file}: {'; '.join(what)}: set model.lora.targets to the "
                          "file's modules")
    for module in sorted(ours):
        for part, param in sorted(ours[module].items()):
            found = theirs[module].get(part)
            if found is None or tuple(found.shape) != tuple(param.shape):
                shape = "nothing" if found is None else f"shape {tuple(found.shape)}"
                raise ConfigError(
                    f"{key}={file}: module {module}: {part} expected shape "
                    f"{tuple(param.shape)}, found {shape} (a different model.lora.rank, "
                    "model.adapter or model.lokr_factor?)")


def adapter_file_path(file: str, key: str) -> Path:
    """The safetensors file `file` names (a folder: its pytorch_lora_weights.safetensors)."""
    path = Path(file).expanduser()
    if path.is_dir():
        path = path / DIFFUSERS_LORA
    if not path.is_file():
        raise ConfigError(f"{key}={file}: no such file (give a .safetensors LoRA file, or a "
                          f"folder holding {DIFFUSERS_LORA})")
    return path
