"""ComfyUI's per-layer quantization layout ("comfy_quant"), read by the layout's own rules, and
the stored form of each Linear it quantizes, kept for the frozen base of a LoRA.

The layout, as ComfyUI 0.33.0 (upstream 783545f6, 2026-08-22) loads it (`comfy/ops.py`'s
quantized Linear loading, `comfy/quant_ops.py`'s QUANT_ALGOS, `comfy/utils.py`
`convert_old_quants`), with the value rules of the comfy-kitchen 0.2.31 layouts it names (eager
backend, Apache-2.0):
- Each quantized layer carries `<layer>.comfy_quant`, a uint8 tensor of JSON bytes
  (`{"format": ..., "convrot": true, "convrot_groupsize": 256, ...}`; older files put the same
  per-layer objects in the safetensors header, `_quantization_metadata` = `{"layers": {...}}`),
  its `<layer>.weight` in the format's storage dtype and `<layer>.weight_scale` (fp32).
- float8_e4m3fn, float8_e5m2: weight = stored.float() * weight_scale (one scale per tensor).
- int8_tensorwise: weight = stored.float() * weight_scale, one scale per tensor or one per
  output row (out, 1) (read for the fp8 formats too: the rule broadcasts the same way). With `convrot` (the "int8 convrot" files, e.g. MiniMax H3's): the rows
  were rotated before quantizing, group by group of `convrot_groupsize` input columns, by the
  normalized regular Hadamard matrix H (Kronecker powers of the 4x4 regular Hadamard, / sqrt(n):
  symmetric and orthogonal, so H @ H = I); weight = (stored.float() * weight_scale) @ H per group.
- nvfp4: `<layer>.weight` uint8, two 4-bit e2m1 codes a byte (high nibble first; values 0, 0.5,
  1, 1.5, 2, 3, 4, 6 and their negatives), `<layer>.weight_scale` one float8_e4m3fn scale per 16
  values of a row, `<layer>.weight_scale_2` an fp32 scale for the tensor: weight = value *
  block scale * weight_scale_2.
- mxfp8: `<layer>.weight` float8_e4m3fn, `<layer>.weight_scale` one e8m0 power of two per 32
  values of a row (2^(byte - 127); byte 0 reads as 0, as comfy-kitchen reads it).
  Both keep their block scales in cuBLAS's tiled order for block-scaled matmuls (blocks of 128
  rows x 4 scale columns; in a block, row r0 + 32 r1 and column c at r0 * 16 + r1 * 4 + c),
  padded to whole blocks; the weights' own padding (rows or columns not multiples of 16 / 32)
  cannot be told from the file alone and is not read.
- `<layer>.input_scale` (activations' fp8 scale for ComfyUI's fp8 matmuls) is unused: dpipe
  multiplies in the training precision.
Formats not read (convrot_w4a4, asym_w4a8_int8: 4-bit with rotations or codebooks) are refused
with their layers named.

The float8 and int8 formats, and the older layouts of `quantized_files.py` (ComfyUI loads those
as float8_e4m3fn layers: `convert_old_quants`), map onto dpipe's 8-bit base storage (`dpipe.train.fp8.QuantizedLinear`: 8-bit values
with an fp32 scale per output row; a tensor's one scale is that scale on every row). A convrot
Linear multiplies in the rotated basis: x @ W^T = (x @ H) @ stored^T * scale (H symmetric), so
its stored bytes stay as they are and the input is rotated first (`StoredForm.group`). nvfp4
(4 bits) and mxfp8 (a scale per 32 values) have no such form there: they are read dequantized
(a LoRA's base then in the training precision, or as model.base_dtype stores it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from dpipe.errors import ModelLoadError

CONF = ".comfy_quant"
WEIGHT_SCALE = ".weight_scale"
INPUT_SCALE = ".input_scale"
WEIGHT_SCALE_2 = ".weight_scale_2"
HEADER_KEY = "_quantization_metadata"
# The formats read, and the storage dtype each holds its weights in.
STORAGE = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
           "int8_tensorwise": torch.int8}
# Block-scaled formats: read dequantized. (storage dtype, values per block scale)
BLOCK_SCALED = {"nvfp4": (torch.uint8, 16), "mxfp8": (torch.float8_e4m3fn, 32)}
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
WHAT_DPIPE_READS = (
    "dpipe reads ComfyUI's comfy_quant layers of formats float8_e4m3fn, float8_e5m2, "
    "int8_tensorwise (with or without convrot), nvfp4 and mxfp8, its older scaled fp8 "
    "(`scaled_fp8` marker, "
    "`<module>.scale_weight`) and int8 with `<module>.scale_weight`; convert other formats to "
    "bf16 (or one of these) first")
# Storage codes in the row tables that follow a file's rows through the families' key maps.
_CODES = list(STORAGE.values())


def has_layers(state: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bool:
    return bool(metadata and HEADER_KEY in metadata) or any(k.endswith(CONF) for k in state)


def layer_configs(state: dict[str, torch.Tensor], metadata: dict[str, str] | None,
                  file: Path) -> dict[str, dict]:
    """{layer: its comfy_quant object}, from the `.comfy_quant` tensors (taken out of `state`)
    and the header's `_quantization_metadata`; refuses formats dpipe does not read."""
    layers = {}
    if metadata and HEADER_KEY in metadata:
        layers.update(json.loads(metadata[HEADER_KEY]).get("layers", {}))
    for key in [k for k in state if k.endswith(CONF)]:
        raw = state.pop(key)
        try:
            layers[key.removesuffix(CONF)] = json.loads(raw.numpy().tobytes())
        except (ValueError, TypeError):
            raise ModelLoadError(f"{file}: {key} is not the JSON object ComfyUI stores there") \
                from None
    unread = {layer: conf.get("format") for layer, conf in layers.items()
              if conf.get("format") not in STORAGE and conf.get("format") not in BLOCK_SCALED}
    if unread:
        first = sorted(unread)[:3]
        raise ModelLoadError(
            f"{file} is quantized in a layout dpipe does not read: layers {first} have comfy_quant"
            f" formats {sorted({str(f) for f in unread.values()})} ({len(unread)} layers in all)."
            f" {WHAT_DPIPE_READS}")
    return layers


def hadamard(size: int) -> torch.Tensor:
    """The normalized regular Hadamard matrix of `size` (a power of 4), fp32."""
    if size < 4 or 4 ** round(math.log(size, 4)) != size:
        raise ValueError(f"convrot_groupsize {size} is not a power of 4")
    base = torch.tensor([[1., 1., 1., -1.], [1., 1., -1., 1.], [1., -1., 1., 1.],
                         [-1., 1., 1., 1.]])
    h = base
    while h.shape[0] < size:
        h = torch.kron(h, base)
    return h / math.sqrt(size)


def rotated(weight: torch.Tensor, group: int) -> torch.Tensor:
    """`weight` (rows, cols) times H, group by group of `group` columns (H @ H = I: the same
    call rotates and rotates back)."""
    rows, cols = weight.shape
    if cols % group:
        raise ValueError(f"{cols} input columns do not split into convrot groups of {group}")
    h = hadamard(group).to(weight.device, weight.dtype)
    return (weight.reshape(rows, cols // group, group) @ h).reshape(rows, cols)


def convrot_group(conf: dict) -> int:
    params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
    if not conf.get("convrot", params.get("convrot", False)):
        return 0
    return int(conf.get("convrot_groupsize", params.get("convrot_groupsize", 256)))


def dequantized_layers(state: dict[str, torch.Tensor], layers: dict[str, dict], file: Path,
                       dtype: torch.dtype, part: bool = False) -> tuple[dict[str, torch.Tensor],
                                                                        dict]:
    """(`state` with each quantized layer's weight as its true values in `dtype`, computed in
    fp32, and its scales left out; {weight key: its row table}): a row table is a float64
    (rows, 3) tensor of [scale, storage code, convrot group] per output row, which the families'
    key maps split and stack as they do the weight's rows (float64: no weight of a model is).
    `part`: `state` is part of a file checked whole, and holds only some of its layers."""
    out, tables = {}, {}
    if part:
        layers = {layer: conf for layer, conf in layers.items() if f"{layer}.weight" in state}
    for layer, conf in layers.items():
        weight_key = f"{layer}.weight"
        if weight_key not in state or layer + WEIGHT_SCALE not in state:
            raise ModelLoadError(f"{file}: {layer}{CONF} names a layer without "
                                 f"{'a weight' if weight_key not in state else 'a weight_scale'}")
    for key in list(state):
        if key.endswith((INPUT_SCALE, WEIGHT_SCALE, WEIGHT_SCALE_2)):
            continue
        value = state.pop(key)
        layer = key.removesuffix(".weight")
        conf = layers.get(layer) if key.endswith(".weight") else None
        if conf is None:
            out[key] = value
            continue
        if conf["format"] in BLOCK_SCALED:
            out[key] = block_dequantized(value, state, layer, conf["format"], file).to(dtype)
            continue
        storage = STORAGE[conf["format"]]
        if value.dtype != storage:
            raise ModelLoadError(f"{file}: {key} is {value.dtype}, but its comfy_quant format "
                                 f"{conf['format']} stores {storage}")
        scale = state[layer + WEIGHT_SCALE].to(torch.float32)
        rows = value.shape[0]
        if scale.numel() == 1:
            scale = scale.reshape(1).expand(rows)
        elif scale.numel() == rows and scale.shape in ((rows,), (rows, 1)):
            scale = scale.reshape(rows)
        else:
            raise ModelLoadError(
                f"{file}: {layer}{WEIGHT_SCALE} has shape {tuple(scale.shape)}; dpipe reads one "
                f"scale per tensor or one per output row ({rows}, 1)")
        group = convrot_group(conf)
        weight = value.to(torch.float32) * scale.reshape(-1, *([1] * (value.dim() - 1)))
        if group:
            try:
                weight = rotated(weight, group)
            except ValueError as err:
                raise ModelLoadError(f"{file}: {key}: {err}") from None
        out[key] = weight.to(dtype)
        if value.dim() == 2:
            tables[key] = row_table(scale, storage, group)
    return out, tables


def from_tiled(scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A (rows, cols) block-scale matrix from cuBLAS's tiled order (see the module's docstring):
    blocks of 128 rows x 4 columns, in a block row r0 + 32 r1, column c at r0 * 16 + r1 * 4 + c."""
    row_blocks, col_blocks = -(-rows // 128), -(-cols // 4)
    tiled = scales.reshape(row_blocks, col_blocks, 32, 4, 4)  # block, block, r0, r1, c
    return tiled.permute(0, 3, 2, 1, 4).reshape(row_blocks * 128, col_blocks * 4)[:rows, :cols]


def block_dequantized(value: torch.Tensor, state: dict[str, torch.Tensor], layer: str, fmt: str,
                      file: Path) -> torch.Tensor:
    """The fp32 values of an nvfp4 or mxfp8 `layer` (its scales in `state`)."""
    storage, block = BLOCK_SCALED[fmt]
    scale = state[layer + WEIGHT_SCALE]
    if value.dtype not in (storage, torch.uint8) or value.dim() != 2:
        raise ModelLoadError(f"{file}: {layer}.weight is a {value.dim()}-D {value.dtype} tensor, "
                             f"not the 2-D {storage} of {fmt}")
    if fmt == "nvfp4":
        codes = torch.stack([value >> 4, value & 0x0F], dim=-1).reshape(value.shape[0], -1)
        values = E2M1.to(codes.device)[codes.long()]  # meta stays meta: no values made
        blocks = scale.view(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        tensor_scale = state.get(layer + WEIGHT_SCALE_2)
        if tensor_scale is None:
            raise ModelLoadError(f"{file}: the nvfp4 layer {layer} has no weight_scale_2")
    else:
        values = value.view(torch.float8_e4m3fn).to(torch.float32)
        exponents = scale.view(torch.uint8).to(torch.int32)
        blocks = torch.where(exponents == 0, 0.0, torch.exp2((exponents - 127).float()))
        tensor_scale = torch.ones(())
    rows, cols = values.shape
    if cols % block or blocks.numel() != -(-rows // 128) * 128 * -(-(cols // block) // 4) * 4:
        raise ModelLoadError(
            f"{file}: {layer}.weight_scale holds {blocks.numel()} block scales, not the tiled "
            f"scales of a {rows}x{cols} {fmt} weight")
    per_block = from_tiled(blocks, rows, cols // block) * tensor_scale.to(torch.float32)
    return (values.reshape(rows, -1, block) * per_block[..., None]).reshape(rows, cols)


def row_table(scale: torch.Tensor, storage: torch.dtype, group: int = 0) -> torch.Tensor:
    """A weight's row table: [scale, storage code, convrot group] per row, float64 (rows, 3)."""
    rows, on = scale.shape[0], dict(dtype=torch.float64, device=scale.device)  # meta stays meta
    return torch.stack([scale.double(), torch.full((rows,), float(_CODES.index(storage)), **on),
                        torch.full((rows,), float(group), **on)], 1)


@dataclass
class StoredForm:
    """A Linear's weight as the file stores it: `values` (out, in) in `storage` (fp8 or int8),
    `scale` (out,) fp32, and the convrot `group` its rows were rotated in (0: none).
    `weight_elided`: the Linear's weight is a placeholder of its shape and dtype holding no
    memory (a stage read from the file keeps one form of each weight, not two); whoever drops
    the form without taking it gives the Linear `dequantized()` (`dpipe.train.fp8`)."""
    values: torch.Tensor
    scale: torch.Tensor
    group: int = 0
    weight_elided: bool = False

    def dequantized(self) -> torch.Tensor:
        weight = self.values.to(torch.float32) * self.scale[:, None]
        return rotated(weight, self.group) if self.group else weight


def stored_form(weight: torch.Tensor, table: torch.Tensor) -> StoredForm | None:
    """The stored form of fp32 `weight` (the file's values after the key map) from its row
    `table`, or None where its rows mix storages or convrot groups. Dividing the fp32 product by
    its scale gives the stored value back exactly: its rounding error (~1e-7) is far below half a
    step of an 8-bit format."""
    if table.dtype != torch.float64 or table.shape != (weight.shape[0], 3):
        return None
    codes, groups = table[:, 1].unique(), table[:, 2].unique()
    if len(codes) != 1 or len(groups) != 1:
        return None
    storage, group = _CODES[int(codes.item())], int(groups.item())
    scale = table[:, 0].to(torch.float32)
    values = rotated(weight.to(torch.float32), group) if group else weight.to(torch.float32)
    values = torch.where(scale[:, None] > 0, values / scale.clamp(min=1e-38)[:, None], 0.0)
    values = values.round() if storage == torch.int8 else values
    return StoredForm(values.to(storage), scale, group)
