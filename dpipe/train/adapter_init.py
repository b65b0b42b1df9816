"""Adapter files going into a run: `model.merge_adapters` (merged into the frozen base weights
before training) and `model.lora.init_from` (the trained adapter's starting weights).

Both read diffusers-format files (`<component>.<module>.lora_A.weight` ..., peft's config in the
metadata), as every dpipe export writes them. Every pipeline stage builds the whole denoiser
before it keeps its own layers (dpipe.train.trainable), so applying them to the denoiser there
gives each stage its own layers' share.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpipe.config.schema import Adapter, ModelConfig
from dpipe.errors import ConfigError
from dpipe.models.adapters import adapter_kind, is_adapter_param, load_adapter_file, modules_of
from dpipe.models.lora_files import DIFFUSERS_LORA, peft_to_diffusers

log = logging.getLogger(__name__)

COMPONENTS = ("transformer", "unet")  # the prefixes diffusers' save_lora_weights writes
# Key starts of files in other layouts (ComfyUI, kohya, LyCORIS, a PeftModel's save): their
# module names are not the denoiser's, and no family here maps them back.
FOREIGN = ("diffusion_model.", "lora_unet_", "lora_transformer_", "lycoris_", "base_model.model.",
           "lora_te")


def read_adapter_file(file: str, key: str, spec=None) -> tuple[Path, str, list[str], dict]:
    """(the file, its component prefix, its keys, peft's config from its metadata or {}) of a
    diffusers-format adapter file; anything else is refused, naming `key` and what to give."""
    from safetensors import safe_open


    path = adapter_file_path(file, key)
    try:
        with safe_open(str(path), "pt") as f:
            keys, meta = list(f.keys()), f.metadata() or {}
    except Exception as err:  # not a safetensors file
        raise ConfigError(f"{key}={file}: not readable as safetensors ({err})") from None
    foreign = [k for k in keys if k.startswith(FOREIGN)]
    if foreign or not any(is_adapter_param(k) for k in keys):
        family = f" for {spec.cfg.family}" if spec is not None else ""
        raise ConfigError(
            f"{key}={file} is not a diffusers-format adapter file (its keys look like "
            f"{(foreign or keys or ['nothing'])[0]!r}): dpipe reads the "
            "pytorch_lora_weights.safetensors its exports write, and has no map back from "
            f"ComfyUI's or kohya's names{family}. Convert it with diffusers first "
            "(`pipe.load_lora_weights(file)` then `pipe.save_lora_weights(dir, "
            "transformer_lora_layers=get_peft_model_state_dict(pipe.transformer))`)")
    first = keys[0].split(".", 1)[0]
    prefix = first if first in COMPONENTS else ""
    config = json.loads(meta.get("lora_adapter_metadata", "{}"))
    if prefix:
        config = {k.removeprefix(f"{prefix}."): v for k, v in config.items()
                  if k.startswith(f"{prefix}.")}
    return path, prefix, keys, config


def merge_adapters(denoiser: nn.Module, files: list[str]) -> None:
    """Merges each file's adapter into `denoiser`'s weights, in order (W += its delta, as peft
    merges it), leaving plain modules: the base the run trains on."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for i, file in enumerate(files):
        key = f"model.merge_adapters[{i}]"
        path, prefix, _keys, _config = read_adapter_file(file, key)
        name = f"merged{i}"
        try:
            load_adapter_file(denoiser, path, prefix, adapter_name=name)
        except (ValueError, RuntimeError) as err:
            raise ConfigError(f"{key}={file} does not fit the model: {err}") from None
        for module_name, module in list(denoiser.named_modules()):
            if isinstance(module, BaseTunerLayer):
                module.merge(adapter_names=[name])
                parent_name, _, child = module_name.rpartition(".")
                parent = denoiser.get_submodule(parent_name) if parent_name else denoiser
                setattr(parent, child, module.get_base_layer())
        if hasattr(denoiser, "peft_config"):
            del denoiser.peft_config
        log.info("merged %s into the base weights", path)


def init_adapter(denoiser: nn.Module, cfg: ModelConfig, default_targets) -> None:
    """Loads model.lora.init_from into the adapter `make_trainable` put on `denoiser`: every
    adapter weight of the model from the file, shapes equal, the same alpha."""
    from dpipe.models.adapters import adapter_metadata
    from safetensors.torch import load_file

    file, key = cfg.lora.init_from, "model.lora.init_from"
    path, prefix, keys, config = read_adapter_file(file, key)
    kind = adapter_kind(keys)
    if kind != Adapter(cfg.adapter):
        raise ConfigError(f"{key}={file} holds a {kind.value} adapter, but this run trains "
                          f"model.adapter={Adapter(cfg.adapter).value}: set "
                          f"model.adapter={kind.value}, or give a {cfg.adapter.value} file")
    ours = adapter_metadata(cfg, default_targets)
    alpha_key = "lora_alpha" if "lora_alpha" in ours else "alpha"
    for name in ("r", alpha_key, "decompose_factor"):
        if name in config and name in ours and config[name] != ours[name]:
            setting = {"r": "model.lora.rank", "lora_alpha": "model.lora.alpha",
                       "alpha": "model.lora.alpha", "decompose_factor": "model.lokr_factor"}[name]
            raise ConfigError(f"{key}={file} was trained with {name}={config[name]}, this run "
                              f"has {setting}={ours[name]}: set {setting}={config[name]}")
    if alpha_key not in config:
        log.warning("%s=%s records no alpha: its weights are taken at this run's scale "
                    "alpha / rank = %s / %s", key, file, ours[alpha_key], ours["r"])
    tensors = {k.removeprefix(f"{prefix}.") if prefix else k: v
               for k, v in load_file(str(path)).items()}
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
