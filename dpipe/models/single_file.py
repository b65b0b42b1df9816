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

Quantized files (ComfyUI's scaled fp8, int8 with scales: `common/quantized_files.py`; its
per-layer `comfy_quant` layouts: `common/comfy_quant.py`) are read dequantized, so the families'
key maps see ordinary weights. Their scaled rows also carry a row table (scale, storage,
convrot group) through the same key map, so that a LoRA run keeps each Linear's stored 8-bit form
as its frozen base (`keep_stored`; `dpipe.train.stored_base`). GGUF files (`common/gguf_files.py`)
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
from dpipe.models.common import comfy_quant
from dpipe.models.common.gguf_files import GGUF_SUFFIX, keep_quantized, read_gguf
from dpipe.models.common.quantized_files import (QUANTIZED_DTYPES, dequantized_with_tables,
                                                 is_quantization_key, quantized_format)

log = logging.getLogger(__name__)

# Prefixes in front of the original names in the files users hold: ComfyUI's saves, NVIDIA's.
# The prefixes single files keep the denoiser's keys behind: ComfyUI's checkpoints and
# diffusion models, NVIDIA's (Cosmos, Anima).
FILE_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "net.")

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


def keeps_stored_base(cfg) -> bool:
    """Whether a run keeps a quantized file's stored 8-bit Linears as its frozen base: a LoRA with
    model.base_dtype at auto, or with model.base_compute=fp8|int8, whose matmuls take the Linears
    the file stores in their format as they are (`dpipe.train.fp8.stored_as`). A
    model.base_dtype of its own asks for dpipe's storage, made from the file's values."""
    from dpipe.config.schema import BaseCompute, BaseDtype, TrainMode

    if getattr(cfg, "mode", None) != TrainMode.lora:
        return False
    dtype = getattr(cfg, "base_dtype", BaseDtype.auto)
    compute = getattr(cfg, "base_compute", BaseCompute.auto)
    return dtype == BaseDtype.auto or (compute != BaseCompute.auto
                                       and dtype.value == compute.value)


def check_single_file(single_file: Path | None) -> None:
    if single_file is not None and not single_file.is_file():
        raise ModelLoadError(f"model.path={single_file} does not exist")


def read_single_file(file: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every key of `file` (read as diffusers' `from_single_file` reads it: safetensors, or a
    torch pickle loaded weights-only), quantized weights dequantized to `dtype` and their scales
    and markers left out; other tensors as stored."""
    return read_with_row_tables(file, dtype)[0]


def read_with_row_tables(file: Path, dtype: torch.dtype
                         ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(`read_single_file`'s state, the row tables of its comfy_quant Linear weights: see
    `comfy_quant.dequantized_layers`)."""
    from diffusers.loaders.single_file_utils import load_single_file_checkpoint

    state = load_single_file_checkpoint(str(file))
    return dequantized_state(state, _header(file), file, dtype, describe=True)


def dequantized_state(state: dict[str, torch.Tensor], metadata: dict[str, str] | None,
                      file: Path, dtype: torch.dtype, describe: bool = False, part: bool = False
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`read_with_row_tables` of the file's tensors `state` (its header's `metadata`): the
    rules of its quantization layout, whichever it is, applied tensor by tensor, so that a
    stage's tensors come out as the whole file's (`dpipe.models.single_file_weights`).
    `describe`: log the layout. `part`: `state` is some weights of a file checked whole, with
    their scales, its comfy_quant entries and its markers."""
    if comfy_quant.has_layers(state, metadata):
        layers = comfy_quant.layer_configs(state, metadata, file)
        if describe:
            formats = sorted({c["format"] + (" convrot" if comfy_quant.convrot_group(c) else "")
                              for c in layers.values()})
            log.info("%s: %d comfy_quant layers (%s), read as their values in %s", file,
                     len(layers), ", ".join(formats), str(dtype).removeprefix("torch."))
        return comfy_quant.dequantized_layers(state, layers, file, dtype, part)
    fmt = quantized_format(state, file)
    if fmt is not None and describe:
        log.info("%s: %s, dequantized to %s", file, fmt, str(dtype).removeprefix("torch."))
    return dequantized_with_tables(state, file, dtype)


def _header(file: Path) -> dict[str, str] | None:
    if Path(file).suffix != ".safetensors":
        return None
    from safetensors import safe_open

    with safe_open(str(file), "pt") as source:
        return source.metadata()


def converted_or_refused(convert: Callable, state: dict[str, torch.Tensor], model, file: Path,
                         title: str) -> dict[str, torch.Tensor]:
    """`convert(state, model)`, a family's single-file names -> diffusers'; a file whose names
    or sizes are another model's is refused, naming the file."""
    try:
        return convert(state, model)
    except (KeyError, RuntimeError, ValueError) as err:
        raise ModelLoadError(
            f"{file} is not a {title} checkpoint in the layout dpipe reads "
            f"(converting its names failed: {err!r})") from None


def load_transformer_file(model_cls, config_dir: Path, file: Path, dtype: torch.dtype,
                          convert: Callable | None = None, title: str | None = None,
                          gguf_architectures: tuple[str, ...] = (),
                          keep_stored: bool = False) -> torch.nn.Module:
    """A diffusers transformer from one file (`read_single_file`, or a GGUF file whose
    `general.architecture` is one of `gguf_architectures`, kept quantized): keys stripped of
    ComfyUI's "model.diffusion_model." prefix, mapped by `convert(state, model)` when the file
    uses other names, loaded into weights allocated once (no random init of billions of
    parameters). `title`: the model's name in messages. `keep_stored` (fp32 loads): each Linear
    of a quantized file (scaled fp8, int8, comfy_quant) also keeps its stored form
    (`comfy_quant.StoredForm`, as the attribute `stored_form`) for a LoRA's frozen base."""
    from accelerate import init_empty_weights

    gguf = file.suffix == GGUF_SUFFIX
    read, tables = ((read_gguf(file, title or model_cls.__name__, gguf_architectures), {})
                    if gguf else read_with_row_tables(file, dtype))
    state, tables = ({converter_name(k): v for k, v in found.items()}
                     for found in (read, tables))
    with init_empty_weights():
        model = model_cls.from_config(model_cls.load_config(config_dir))
    keep_stored = keep_stored and dtype == torch.float32 and bool(tables)
    if convert is not None:
        with_tables = {**state, **tables} if keep_stored else None
        state = converted_or_refused(convert, state, model, file, model_cls.__name__)
        if keep_stored:
            tables = mapped_tables(convert, with_tables, model, file)
    if gguf:
        state = keep_quantized(model, state, file, dtype)
    check_names(file, model_cls.__name__, set(model.state_dict()), set(state))
    model.load_state_dict(in_load_dtypes(state, model, dtype), strict=True, assign=True)
    if keep_stored:
        _attach_stored_forms(model, tables, file)
    return model


def converter_name(key: str) -> str:
    """A single file's key as the families' converters take it: without ComfyUI's
    "model.diffusion_model." (or "diffusion_model.") prefix."""
    return key.removeprefix("model.").removeprefix("diffusion_model.")


def check_names(file: Path, title: str, expected: set[str], found: set[str]) -> None:
    """Raises ModelLoadError unless the converted names `found` of `file` are the model's."""
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise ModelLoadError(
            f"{file} is not a {title} checkpoint in the layout dpipe reads: "
            f"{len(missing)} weights missing (e.g. {missing[:3]}), {len(unexpected)} unexpected "
            f"(e.g. {unexpected[:3]})")


def mapped_tables(convert: Callable, with_tables: dict[str, torch.Tensor], model,
                   file: Path) -> dict[str, torch.Tensor]:
    """The row tables under the diffusers names: the key map run once more on the file's state
    with each table in place of its weight (the map moves rows; the tables are float64)."""
    try:
        mapped = convert(with_tables, model)
    except Exception as err:  # a map that reshapes columns: the values load all the same
        log.info("%s: its stored 8-bit forms do not pass the key map (%r): its weights are "
                 "used dequantized", file, err)
        return {}
    return {k: v for k, v in mapped.items() if v.dtype == torch.float64}


def _attach_stored_forms(model, tables: dict[str, torch.Tensor], file: Path) -> None:
    kept, left = 0, 0
    for name, module in model.named_modules():
        table = tables.get(f"{name}.weight")
        if table is None:
            continue
        form = (comfy_quant.stored_form(module.weight.detach(), table)
                if type(module) is torch.nn.Linear else None)
        if form is None:
            left += 1
            continue
        module.stored_form = form
        kept += 1
    log.info("%s: %d Linears keep their stored 8-bit form, %d (not Linears, or rows of mixed "
             "formats) are used dequantized", file, kept, left)


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
                           prefix: str = "", dtype: torch.dtype | None = None,
                           extra: dict[str, torch.Tensor] | None = None,
                           format_metadata: bool = True) -> Path:
    """The diffusers transformer in `transformer_dir` (its safetensors shards) as one file of the
    original layout: names mapped by `to_original`, each key after `prefix`
    ("model.diffusion_model." as ComfyUI saves), in `dtype` (None: as stored), with the `extra`
    tensors (full names: the released file's other parts or training buffers). A .pt `file` is a
    plain state dict (torch.save); a safetensors one has the metadata {"format": "pt"} unless
    `format_metadata` is false. The tiny factories' single files."""
    from safetensors.torch import load_file, save_file

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(transformer_dir).glob("*.safetensors")):
        weights.update(load_file(shard))
    tensors = {prefix + k: (v if dtype is None else v.to(dtype)).contiguous()
               for k, v in to_original(weights).items()}
    tensors.update(extra or {})
    if file.suffix == ".pt":
        torch.save(tensors, file)
    else:
        save_file(tensors, file, metadata={"format": "pt"} if format_metadata else None)
    return file


def export_like_source(folder: Path, source: Path, to_original: Callable, out_dir: Path) -> Path:
    """Write the diffusers transformer in `folder` (its safetensors shards) as `out_dir /
    source.name`, laid out as `source`. `to_original` maps diffusers names to the original
    names without prefix. Returns the file written. A quantized source's scaled weights are
    written in bf16 without their scales and marker: a plain file that loads where the source
    did (its scales were fitted to the base weights, not the trained ones), with the source's
    header (`plain_header`)."""
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
        if name in trained:  # 8-bit values, or nvfp4's packed bytes: the trained weight in bf16
            dtype = (torch.bfloat16 if value.dtype in (*QUANTIZED_DTYPES, torch.uint8)
                     else value.dtype)
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
        save_file(out, path, metadata=plain_header(source))
    return path


def plain_header(source: Path) -> dict[str, str]:
    """The header metadata of a plain file written in `source`'s layout: the source's, which
    tools read the model from (ComfyUI builds LTX-2 / 2.3's transformer and VAE from its
    `config`, MiniMax H3's and some Wan variants' too: `comfy/model_detection.py`, 783545f6),
    without its comfy_quant layout, since the file written holds no scales."""
    header = dict(_header(source) or {})
    header.pop(comfy_quant.HEADER_KEY, None)
    header.setdefault("format", "pt")
    return header


def _unprefixed(key: str) -> str:
    for prefix in FILE_PREFIXES:
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


# The single blocks' fused `linear1` of the FLUX-style original layouts (Chroma's, HunyuanVideo's):
# q, k, v and the MLP input stacked, in that order.
SINGLE_LINEAR1 = re.compile(r"single_blocks\.(\d+)\.linear1\.(weight|bias)")
LINEAR1_PARTS = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")


def split_linear1(key: str, value: torch.Tensor, model) -> dict[str, torch.Tensor]:
    """A single block's fused `linear1` weight or bias (`key` matches SINGLE_LINEAR1) -> its
    diffusers parts, split at `model`'s own sizes (diffusers' converters split it at the width of
    their one released model); ValueError where the rows differ (another model's file)."""
    index, param = SINGLE_LINEAR1.fullmatch(key).groups()
    block = model.single_transformer_blocks[int(index)]
    sizes = [block.attn.to_q.out_features, block.attn.to_k.out_features,
             block.attn.to_v.out_features, block.proj_mlp.out_features]
    if value.shape[0] != sum(sizes):
        raise ValueError(f"{key} has {value.shape[0]} rows; this model's config gives "
                         f"{sum(sizes)} ({' + '.join(map(str, sizes))})")
    return {f"single_transformer_blocks.{index}.{part}.{param}": piece
            for part, piece in zip(LINEAR1_PARTS, value.split(sizes, dim=0))}
