"""A single file's weights read as values and written back in the file's own layout, for
`dpipe-lora merge` into the file users run: plain safetensors (each weight back in its dtype),
ComfyUI's quantized files (`quantized_files.py`, `comfy_quant.py`) and GGUF files
(`gguf_files.py`).

A changed weight of a quantized file is requantized as ComfyUI requantizes a patched weight
(ComfyUI 0.33.0, upstream 783545f6: `comfy/model_patcher.py` `patch_weight_to_device`
dequantizes the weight, adds the LoRA's delta in fp32 and calls the layer's `set_weight`, whose
`requantize_from_float(scale="recalculate")` runs the layout's quantizer, `comfy/quant_ops.py`
and comfy-kitchen 0.2.31's eager rules):
- float8 (comfy_quant float8_e4m3fn / float8_e5m2, scaled fp8): scale = amax(|W|) / the format's
  largest value, value = W / scale in the format;
- int8_tensorwise: scale = max(amax(|W|) / 127, 1e-30), value = round(W / scale) clamped to
  [-128, 127]; convrot: the rows rotated by H group by group first, then per row.
Scales are recalculated over the whole tensor, or per row where the file stores one per row
(comfy-kitchen keeps a per-row int8 layer per row; ComfyUI's fp8 rule would make a per-row fp8
scale one per tensor: kept per row here, the file's layout).
Values are rounded to nearest, as ComfyUI's quantizers write files (ComfyUI rounds a weight it
patches in memory stochastically, seeded by the key: its merged weights differ from a file's by
up to one step). The block-scaled nvfp4 and mxfp8 layers are not requantized (refused).
A GGUF tensor is requantized in its own block type by the `gguf` package's quantizer (the
format's own rule: Q8_0 a scale per 32 values = amax / 127 in fp16); K-quants, which the package
does not quantize, are refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dpipe.errors import UserError
from dpipe.io import atomic_write
from dpipe.models.common.comfy_quant import (BLOCK_SCALED, CONF, HEADER_KEY, STORAGE,
                                             WEIGHT_SCALE, WHAT_DPIPE_READS, convrot_group,
                                             rotated)
from dpipe.models.common.gguf_files import GGUF_SUFFIX
from dpipe.models.common.quantized_files import FP8_FORMATS, SCALE


def open_weights(file: Path, device: str = "cpu") -> StoredWeights:
    """The weights of the safetensors or GGUF `file`."""
    if file.suffix == GGUF_SUFFIX:
        return GGUFWeights(file)
    return SafetensorsWeights(file, device)


class StoredWeights:
    """A file's tensors: `shapes` {weight key: shape} of its weight matrices and kernels,
    `value(key)` a weight's fp32 values, `store(key, values)` sets them in the file's layout,
    `save(path)` writes the file atomically."""

    shapes: dict[str, tuple[int, ...]]

    def value(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def store(self, key: str, values: torch.Tensor) -> None:
        raise NotImplementedError

    def save(self, path: Path) -> Path:
        raise NotImplementedError


def _quantize(values: torch.Tensor, storage: torch.dtype, per_row: bool, group: int):
    """(stored values, fp32 scale) of fp32 `values` by the rules in the module's docstring;
    the scale has shape () or (rows, 1)."""
    if group:
        values = rotated(values, group)
    amax = values.abs().amax(dim=1, keepdim=True) if per_row else values.abs().amax()
    if storage == torch.int8:
        scale = (amax / 127.0).clamp(min=1e-30)
        return (values * (1.0 / scale)).round().clamp(-128, 127).to(torch.int8), scale
    top = torch.finfo(storage).max
    scale = (amax / top).clamp(min=1e-30)
    return (values / scale).clamp(-top, top).to(storage), scale


class SafetensorsWeights(StoredWeights):
    """A safetensors file, plain or quantized in one of ComfyUI's 8-bit layouts."""

    def __init__(self, file: Path, device: str = "cpu"):
        from safetensors import safe_open

        self.file = file
        with safe_open(str(file), "pt", device=device) as f:
            self.metadata = f.metadata()
            self.tensors = {key: f.get_tensor(key) for key in f.keys()}
        # {weight key: (comfy_quant format or None for the older layouts, convrot group)}
        self.layers: dict[str, tuple[str | None, int]] = {}
        confs = {}
        if self.metadata and HEADER_KEY in self.metadata:
            confs.update(json.loads(self.metadata[HEADER_KEY]).get("layers", {}))
        confs.update({k.removesuffix(CONF): json.loads(v.cpu().numpy().tobytes())
                      for k, v in self.tensors.items() if k.endswith(CONF)})
        for layer, conf in confs.items():
            self.layers[f"{layer}.weight"] = (conf.get("format"), convrot_group(conf))
        for key in self.tensors:
            if key.endswith(SCALE) and key.removesuffix(SCALE) + ".weight" in self.tensors:
                self.layers.setdefault(key.removesuffix(SCALE) + ".weight", (None, 0))
        self.shapes = {key: tuple(value.shape) for key, value in self.tensors.items()
                       if key.endswith(".weight") and value.dim() >= 2}

    def _scale_key(self, key: str) -> str:
        fmt, _ = self.layers[key]
        return key.removesuffix(".weight") + (SCALE if fmt is None else WEIGHT_SCALE)

    def _refuse_block_scaled(self, key: str) -> None:
        fmt = self.layers[key][0]
        if fmt not in STORAGE and fmt is not None:
            raise UserError(
                f"{self.file}: {key} is an {fmt} layer: dpipe-lora merges into ComfyUI's 8-bit "
                f"layers ({', '.join(STORAGE)}, scaled fp8, int8 with scale_weight), not "
                f"{' or '.join(BLOCK_SCALED)}: merge into the bf16 file instead")

    def value(self, key: str) -> torch.Tensor:
        stored = self.tensors[key]
        if key not in self.layers:
            if stored.dtype == torch.int8:
                raise UserError(f"{self.file}: {key} is int8 without a scale, not a layout "
                                f"dpipe reads. {WHAT_DPIPE_READS}")
            return stored.float()
        self._refuse_block_scaled(key)
        scale = self.tensors[self._scale_key(key)].float()
        scale = scale.reshape(-1, *([1] * (stored.dim() - 1))) if scale.numel() > 1 else scale
        weight = stored.float() * scale
        group = self.layers[key][1]
        return rotated(weight, group) if group else weight

    def store(self, key: str, values: torch.Tensor) -> None:
        stored = self.tensors[key]
        if key not in self.layers:
            if stored.dtype in FP8_FORMATS:  # an fp8 weight without a scale: saturate, not NaN
                top = torch.finfo(stored.dtype).max
                values = values.clamp(-top, top)
            self.tensors[key] = values.to(stored.dtype)
            return
        self._refuse_block_scaled(key)
        scale_key = self._scale_key(key)
        old_scale = self.tensors[scale_key]
        group = self.layers[key][1]
        quantized, scale = _quantize(values.float(), stored.dtype, old_scale.numel() > 1 or
                                     bool(group), group)
        self.tensors[key] = quantized
        self.tensors[scale_key] = scale.reshape(old_scale.shape).to(old_scale.dtype)

    def save(self, path: Path) -> Path:
        from safetensors.torch import save_file

        tensors = {k: v.contiguous().cpu() for k, v in self.tensors.items()}
        return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=self.metadata))


class GGUFWeights(StoredWeights):
    """A GGUF file: its metadata fields and tensors in their block types."""

    def __init__(self, file: Path):
        from gguf import GGUFReader

        self.file = file
        self.reader = GGUFReader(str(file))
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.changed: dict[str, object] = {}  # name -> the new data (numpy, the file's type)
        self.shapes = {t.name: tuple(int(n) for n in reversed(t.shape.tolist()))
                       for t in self.reader.tensors
                       if t.name.endswith(".weight") and len(t.shape) >= 2}

    def value(self, key: str) -> torch.Tensor:
        from gguf.quants import dequantize

        tensor = self.tensors[key]
        return torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy()).float()

    def store(self, key: str, values: torch.Tensor) -> None:
        from gguf.quants import quantize

        qtype = self.tensors[key].tensor_type
        array = values.float().cpu().numpy()
        if qtype.name in ("F32", "F16"):
            self.changed[key] = array.astype("float16" if qtype.name == "F16" else "float32")
            return
        try:
            self.changed[key] = quantize(array, qtype)
        except NotImplementedError:
            raise UserError(f"{self.file}: {key} is {qtype.name}, which the gguf package does not "
                            "quantize: merge into the bf16 file and convert that to GGUF "
                            "(Q8_0, Q4_0, Q5_0, ... merge in place)") from None

    def save(self, path: Path) -> Path:
        from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

        arch = self.reader.fields["general.architecture"].contents()

        def write(tmp):
            writer = GGUFWriter(tmp, arch=arch)
            for name, field in self.reader.fields.items():
                if name.startswith("GGUF.") or name == "general.architecture":
                    continue
                kind = field.types[0]
                writer.add_key_value(name, field.contents(), kind, sub_type=field.types[-1]
                                     if kind == GGUFValueType.ARRAY else None)
            for name, tensor in self.tensors.items():
                data = self.changed.get(name, tensor.data)
                plain = tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
                writer.add_tensor(name, data, raw_dtype=None if plain else tensor.tensor_type)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()

        return atomic_write(path, write)

