"""Quantized single files read as ordinary weights: ComfyUI's scaled fp8 checkpoints
("fp8_scaled") and int8 weights with scales.

Layouts read (keys after any prefix, e.g. ComfyUI's "model.diffusion_model."):
- scaled fp8: the marker `scaled_fp8`, a tensor (often empty) whose dtype names the format,
  float8_e4m3fn or float8_e5m2 (an fp32 marker, as older files hold, means e4m3fn); each quantized
  Linear's `<module>.weight` in fp8 beside `<module>.scale_weight` (fp32: one value for the
  tensor, or one per output row, shape (out,) or (out, 1)); optionally `<module>.scale_input`.
- int8 with scales: `<module>.weight` in int8 beside `<module>.scale_weight` as above (no marker).
- fp8 weights without a `scale_weight` (plain fp8 files) are read as they are (scale 1).
The true weight is weight.float() * scale_weight, computed in fp32 one tensor at a time and
stored in the training dtype; biases and norms, unquantized in such files, pass through.

ComfyUI's newer per-layer layout (`comfy_quant`, `weight_scale`) is read by `comfy_quant.py`.
Any other quantization layout (bitsandbytes, GPTQ/AWQ) is refused with its keys named: reading it
as plain weights would train on wrong values.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpipe.errors import ModelLoadError
from dpipe.models.common.comfy_quant import CONF, INPUT_SCALE as LAYER_INPUT_SCALE
from dpipe.models.common.comfy_quant import (WEIGHT_SCALE, WEIGHT_SCALE_2, WHAT_DPIPE_READS,
                                             row_table)

MARKER = "scaled_fp8"
SCALE = ".scale_weight"
# The scale of an fp8 matmul's input (ComfyUI's fp8 matmuls quantize activations with it). dpipe
# upcasts the weight and multiplies in bf16/fp32, so activations are never quantized: unused.
INPUT_SCALE = ".scale_input"
FP8_FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANTIZED_DTYPES = (*FP8_FORMATS, torch.int8)
# Keys of quantization layouts dpipe does not read (their weights are not weight * scale_weight,
# or not with these names): bitsandbytes (absmax, quant_map, quant_state, SCB), GPTQ/AWQ
# (qweight, qzeros, scales, g_idx), the newer per-layer formats (weight_scale, input_scale,
# comfy_quant).
_UNKNOWN = ("weight_scale", "weight_scale_2", "input_scale", "comfy_quant", "absmax",
            "nested_absmax", "quant_map", "nested_quant_map", "SCB", "qweight", "qzeros",
            "scales", "g_idx", "weight_format")


def _leaf(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def is_quantization_key(key: str) -> bool:
    """The markers and the scales: keys of the file that are not weights of the model."""
    return _leaf(key) == MARKER or key.endswith((SCALE, INPUT_SCALE, CONF, WEIGHT_SCALE,
                                                 WEIGHT_SCALE_2, LAYER_INPUT_SCALE))


def file_is_quantized(file: Path) -> bool:
    """Whether a safetensors file holds quantization keys or 8-bit weights (its header only)."""
    from safetensors import safe_open

    if Path(file).suffix != ".safetensors":
        return False
    with safe_open(str(file), "pt") as source:
        keys = list(source.keys())
        if any(is_quantization_key(k) or _leaf(k) in _UNKNOWN for k in keys):
            return True
        return any(source.get_slice(k).get_dtype() in ("F8_E4M3", "F8_E5M2", "I8")
                   for k in keys if k.endswith(".weight"))


def stores_8bit_linears(file: Path) -> bool:
    """Whether a LoRA on `file` keeps its 8-bit Linears as they are stored
    (`dpipe.train.stored_base`): a scaled fp8 or int8 file, or a comfy_quant file whose layers
    are all float8 or int8 (an nvfp4 or mxfp8 layer is read as values). From the header and the
    small per-layer JSON tensors only."""
    import json

    from safetensors import safe_open

    from dpipe.models.common.comfy_quant import HEADER_KEY, STORAGE

    if Path(file).suffix != ".safetensors":
        return False
    with safe_open(str(file), "pt") as source:
        keys = list(source.keys())
        header = (source.metadata() or {}).get(HEADER_KEY)
        confs = [json.loads(source.get_tensor(k).numpy().tobytes()) for k in keys
                 if k.endswith(CONF)]
    if header:
        confs += list(json.loads(header).get("layers", {}).values())
    if confs:
        return all(conf.get("format") in STORAGE for conf in confs)
    return any(_leaf(k) == MARKER or k.endswith(SCALE) for k in keys)


def quantized_format(state: dict[str, torch.Tensor], file: Path) -> str | None:
    """A name for the quantization of `state` ("scaled fp8 (float8_e4m3fn)", "int8 with
    scales"), None for a plain file; refuses layouts dpipe does not read."""
    unknown = [k for k in state if _leaf(k) in _UNKNOWN or ".quant_state." in k]
    if unknown:
        raise ModelLoadError(
            f"{file} is quantized in a layout dpipe does not read: keys {unknown[:3]} "
            f"({len(unknown)} in all). {WHAT_DPIPE_READS}")
    markers = [k for k in state if _leaf(k) == MARKER]
    if markers:
        fmt = state[markers[0]].dtype
        if fmt == torch.float32:  # older ComfyUI files: an fp32 marker stands for e4m3fn
            fmt = torch.float8_e4m3fn
        if fmt not in FP8_FORMATS:
            raise ModelLoadError(
                f"{file}: its marker {markers[0]} has dtype {state[markers[0]].dtype}, not an fp8 "
                f"format dpipe reads (float8_e4m3fn, float8_e5m2, or float32 for e4m3fn). "
                f"{WHAT_DPIPE_READS}")
        return f"scaled fp8 ({str(fmt).removeprefix('torch.')})"
    if any(k.endswith(SCALE) for k in state):
        kinds = {v.dtype for k, v in state.items()
                 if k.endswith(".weight") and v.dtype in QUANTIZED_DTYPES}
        if kinds == {torch.int8}:
            return "int8 with scales"
        return "scaled fp8 (no marker)"
    return None


def dequantized(state: dict[str, torch.Tensor], file: Path,
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state` with each scaled weight replaced by weight * scale_weight in `dtype` and the
    quantization keys left out; a plain file's state comes back as it is."""
    return dequantized_with_tables(state, file, dtype)[0]


def dequantized_with_tables(state: dict[str, torch.Tensor], file: Path, dtype: torch.dtype
                            ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(`dequantized`'s state, the row tables of its scaled 2-D weights, as
    `comfy_quant.dequantized_layers` gives them)."""
    tables = {}
    if quantized_format(state, file) is None:
        if any(v.dtype == torch.int8 for k, v in state.items() if k.endswith(".weight")):
            raise ModelLoadError(
                f"{file} holds int8 weights without `<module>.scale_weight` scales (e.g. "
                f"{next(k for k, v in state.items() if v.dtype == torch.int8)}). "
                f"{WHAT_DPIPE_READS}")
        return state, tables
    out = {}
    keys = set(state)  # in any order: a weight is popped as it is read, its scale stays
    for key in list(state):
        if is_quantization_key(key):
            if key.endswith(SCALE) and key.removesuffix(SCALE) + ".weight" not in keys:
                raise ModelLoadError(f"{file}: {key} scales no weight (no "
                                     f"{key.removesuffix(SCALE)}.weight in the file)")
            continue
        value = state.pop(key)  # frees the quantized tensor as its replacement is made
        scale = state.get(key.removesuffix(".weight") + SCALE) if key.endswith(".weight") else None
        if scale is None and value.dtype == torch.int8:
            raise ModelLoadError(f"{file}: {key} is int8 without a "
                                 f"{key.removesuffix('.weight')}{SCALE}. {WHAT_DPIPE_READS}")
        if scale is None:
            out[key] = value.to(dtype) if value.dtype in FP8_FORMATS else value
            continue
        scale = _broadcast(scale, value, key, file)
        out[key] = (value.to(torch.float32) * scale).to(dtype)
        if value.dim() == 2 and value.dtype in QUANTIZED_DTYPES:
            tables[key] = row_table(scale.reshape(-1).expand(value.shape[0]), value.dtype)
    return out, tables


def _broadcast(scale: torch.Tensor, weight: torch.Tensor, key: str, file: Path) -> torch.Tensor:
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        return scale.reshape(())
    if scale.numel() == weight.shape[0] and scale.shape in ((weight.shape[0],),
                                                            (weight.shape[0], 1)):
        return scale.reshape(-1, *([1] * (weight.dim() - 1)))
    raise ModelLoadError(
        f"{file}: the scale of {key} has shape {tuple(scale.shape)}; dpipe reads one scale per "
        f"tensor or one per output row ({weight.shape[0]},) for a weight of shape "
        f"{tuple(weight.shape)}")


def write_quantized_copy(file: Path, out: Path, fmt: torch.dtype, per_row: bool = False) -> Path:
    """`file` (a plain single file) as `out` in the layouts above: each 2-D `.weight` quantized
    to `fmt` (an fp8 format: with the `scaled_fp8` marker; int8: without) with a `scale_weight`
    per tensor (as ComfyUI's fp8_scaled files) or per output row, fitted so the largest weight
    lands on the format's largest value. Other tensors are copied. The tiny models' quantized
    files, for tests."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(file))
    top = 127.0 if fmt == torch.int8 else torch.finfo(fmt).max
    prefix = next((p for p in ("model.diffusion_model.",) if all(k.startswith(p) for k in state)),
                  "")
    out_state = {} if fmt == torch.int8 else {prefix + MARKER: torch.empty(0, dtype=fmt)}
    for key, value in state.items():
        if not (key.endswith(".weight") and value.dim() == 2):
            out_state[key] = value
            continue
        w = value.to(torch.float32)
        amax = w.abs().amax(dim=1, keepdim=True) if per_row else w.abs().amax()
        scale = amax.clamp(min=1e-12) / top
        q = (w / scale).clamp(-top, top)
        out_state[key] = q.round().to(fmt) if fmt == torch.int8 else q.to(fmt)
        out_state[key.removesuffix(".weight") + SCALE] = scale.reshape(-1 if per_row else ())
    save_file(out_state, str(out), metadata={"format": "pt"})
    return out
