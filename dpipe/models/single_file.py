"""Single-file transformers: loading them, and writing a full fine-tune back in their layout.

Users hold transformers as single files (ComfyUI's model folders, the original releases). A single
file brings only the denoiser: `model.path=<file>` with `model.single_file_config=<the base
model's diffusers folder>` for the VAE, text encoders, tokenizers and configs (`split_path`);
`load_transformer_file` reads the file into the diffusers class, through the family's converter
when the file uses the original names.

Users who trained from a single-file checkpoint load the result where they loaded the file, so the
export writes one more file, named as the source, beside the diffusers folder: every key of the
source in its order, prefix and dtype, each transformer weight replaced by the trained one, and
what the source holds besides the transformer (LTX-Video's VAE, NVIDIA's training buffers) copied
unchanged (`export_like_source`).

Quantized files (ComfyUI's scaled fp8, int8 with scales: `common/quantized_files.py`) are read
dequantized, so the families' key maps see ordinary weights. GGUF files (`common/gguf_files.py`)
stay quantized: the key maps move their blocks whole (rows split and stacked), and the Linears
that take them dequantize at each matmul.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Callable

import torch

from dpipe.errors import ModelLoadError
from dpipe.models.common.gguf_files import GGUF_SUFFIX, keep_quantized, read_gguf
from dpipe.models.common.quantized_files import (QUANTIZED_DTYPES, dequantized,
                                                 is_quantization_key, quantized_format)

log = logging.getLogger(__name__)

# Prefixes in front of the original names in the files users hold: ComfyUI's saves, NVIDIA's.
_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "net.")

SINGLE_FILE_SUFFIXES = (".safetensors",)


def split_path(cfg, suffixes: tuple[str, ...] = SINGLE_FILE_SUFFIXES) -> tuple[Path, Path | None]:
    """(diffusers folder, single-file transformer or None) from model.path and
    model.single_file_config. A single file (the transformer as ComfyUI and the original
    releases store it) brings only the denoiser; the VAE, text encoder, tokenizer and configs come
    from the base model's diffusers folder named by model.single_file_config. `suffixes`: the
    file types the family's releases use (NVIDIA's Cosmos checkpoints are also .pt)."""
    from dpipe.errors import ConfigError

    path = Path(cfg.path).expanduser()
    config = getattr(cfg, "single_file_config", None)
    if path.suffix not in suffixes:
        if config is not None:
            raise ConfigError("model.single_file_config is only used when model.path is a single-"
                              f"file transformer ({', '.join(suffixes)})")
        return path, None
    if not config:
        raise ConfigError(
            f"model.path={path} is a single-file transformer; the VAE, text encoder and configs "
            "come from the base model's diffusers folder: set model.single_file_config=<folder>")
    folder = Path(config).expanduser()
    if not folder.is_dir():  # named by its own key: model.path is the file, and it is there
        raise ModelLoadError(
            f"model.single_file_config={config} {'is a file' if folder.is_file() else 'does not exist'}"
            ": give the base model's diffusers folder (its VAE, text encoders and configs)")
    return folder, path


def check_single_file(single_file: Path | None) -> None:
    if single_file is not None and not single_file.is_file():
        raise ModelLoadError(f"model.path={single_file} does not exist")


def read_single_file(file: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every key of `file` (read as diffusers' `from_single_file` reads it: safetensors, or a
    torch pickle loaded weights-only), quantized weights dequantized to `dtype` and their scales
    and marker left out; other tensors as stored."""
    from diffusers.loaders.single_file_utils import load_single_file_checkpoint

    state = load_single_file_checkpoint(str(file))
    fmt = quantized_format(state, file)
    if fmt is not None:
        log.info("%s: %s, dequantized to %s", file, fmt, str(dtype).removeprefix("torch."))
    return dequantized(state, file, dtype)


def load_transformer_file(model_cls, config_dir: Path, file: Path, dtype: torch.dtype,
                          convert: Callable | None = None, title: str | None = None,
                          gguf_architectures: tuple[str, ...] = ()) -> torch.nn.Module:
    """A diffusers transformer from one file (`read_single_file`, or a GGUF file whose
    `general.architecture` is one of `gguf_architectures`, kept quantized): keys stripped of
    ComfyUI's "model.diffusion_model." prefix, mapped by `convert(state, model)` when the file
    uses other names, loaded into weights allocated once (no random init of billions of
    parameters). `title`: the model's name in messages."""
    from accelerate import init_empty_weights

    gguf = file.suffix == GGUF_SUFFIX
    read = (read_gguf(file, title or model_cls.__name__, gguf_architectures) if gguf
            else read_single_file(file, dtype))
    state = {k.removeprefix("model.").removeprefix("diffusion_model."): v
             for k, v in read.items()}
    with init_empty_weights():
        model = model_cls.from_config(model_cls.load_config(config_dir))
    if convert is not None:
        try:
            state = convert(state, model)
        except (KeyError, RuntimeError, ValueError) as err:  # names or sizes of another model
            raise ModelLoadError(
                f"{file} is not a {model_cls.__name__} checkpoint in the layout dpipe reads "
                f"(converting its names failed: {err!r})") from None
    if gguf:
        state = keep_quantized(model, state, file, dtype)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ModelLoadError(
            f"{file} is not a {model_cls.__name__} checkpoint in the layout dpipe reads: "
            f"{len(missing)} weights missing (e.g. {missing[:3]}), {len(unexpected)} unexpected "
            f"(e.g. {unexpected[:3]})")
    model.load_state_dict(in_load_dtypes(state, model, dtype), strict=True, assign=True)
    return model


def in_load_dtypes(state: dict[str, torch.Tensor], model, dtype: torch.dtype
                   ) -> dict[str, torch.Tensor]:
    """The floating tensors of `state` in `dtype`, but those of the modules the class keeps in
    float32 (`_keep_in_fp32_modules`), as diffusers' `from_pretrained` casts them. The buffers
    a model computes rather than stores (rotary frequencies) stay as built, in float32, as
    from_pretrained leaves them: a cast of the whole model would round them too."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return {name: value.to(torch.float32 if keep & set(name.split(".")) else dtype)
            if value.is_floating_point() else value for name, value in state.items()}


def load_or_fail(fn: Callable[[], Any], what: Path):
    try:
        return fn()
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"cannot load {what}: {err}") from None


def write_transformer_file(transformer_dir: Path, file: Path, to_original: Callable,
                           prefix: str = "", dtype: torch.dtype | None = None) -> Path:
    """The diffusers transformer in `transformer_dir` (its safetensors shards) as one file of the
    original layout: names mapped by `to_original`, each key after `prefix` ("model.diffusion_model."
    as ComfyUI saves), in `dtype` (None: as stored). The tiny factories' single files."""
    from safetensors.torch import load_file, save_file

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(transformer_dir).glob("*.safetensors")):
        weights.update(load_file(shard))
    save_file({prefix + k: (v if dtype is None else v.to(dtype)).contiguous()
               for k, v in to_original(weights).items()},
              file, metadata={"format": "pt"})
    return file


def export_like_source(folder: Path, source: Path, to_original: Callable, out_dir: Path) -> Path:
    """Write the diffusers transformer in `folder` (its safetensors shards) as `out_dir /
    source.name`, laid out as `source`. `to_original` maps diffusers names to the original
    names without prefix. Returns the file written. A quantized source's scaled weights are
    written in bf16 without their scales and marker: a plain file that loads where the source
    did (its scales were fitted to the base weights, not the trained ones)."""
    from diffusers.loaders.single_file_utils import load_single_file_checkpoint
    from safetensors.torch import load_file, save_file

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(shard))
    trained = to_original(weights)
    out, placed = {}, set()
    for key, value in load_single_file_checkpoint(str(source)).items():
        name = _unprefixed(key)
        if is_quantization_key(key):
            continue
        if name in trained:
            dtype = torch.bfloat16 if value.dtype in QUANTIZED_DTYPES else value.dtype
            out[key] = trained[name].to(dtype).contiguous()
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


# ---- diffusers names -> an original layout, for families mapped block by block ----------------
# A block table row: (diffusers prefix, original prefix, {diffusers module: original module},
# {original fused module: the diffusers modules stacked in it, in order}).
BlockTable = list[tuple[str, str, dict[str, str], dict[str, tuple[str, ...]]]]


def block_original_module(module: str, blocks: BlockTable):
    """(original module, the diffusers parts it fuses or None, which part this one is) of a module
    inside a block, or None if no row of `blocks` names it."""
    for prefix, original, renames, fusions in blocks:
        match = re.fullmatch(rf"{prefix}\.(\d+)\.(.+)", module)
        if match is None:
            continue
        index, part = match.groups()
        if part in renames:
            return f"{original}.{index}.{renames[part]}", None, None
        for name, parts in fusions.items():
            if part in parts:
                return f"{original}.{index}.{name}", parts, part
        return None
    return None


class FusedWeights:
    """Collects the diffusers parts of fused original weights and stacks them along the output
    dimension, in the original's order; a fused weight missing a part is an error, never a
    silently short tensor."""

    def __init__(self):
        self._found: dict[str, tuple[tuple[str, ...], dict[str, torch.Tensor]]] = {}

    def add(self, key: str, parts: tuple[str, ...], part: str, value: torch.Tensor) -> None:
        self._found.setdefault(key, (parts, {}))[1][part] = value

    def stacked(self) -> dict[str, torch.Tensor]:
        out = {}
        for key, (parts, found) in self._found.items():
            missing = [p for p in parts if p not in found]
            if missing:
                raise KeyError(f"{key} needs {', '.join(missing)} as well")
            out[key] = torch.cat([found[p] for p in parts], dim=0)
        return out
