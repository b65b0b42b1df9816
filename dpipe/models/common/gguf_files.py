"""GGUF transformers (the files city96's ComfyUI-GGUF tools and llama.cpp's `gguf` package write)
kept quantized: the frozen base of a LoRA stays in the file's blocks and each matmul dequantizes
its weight.

Such a file holds the original checkpoint's names (as the family's single files do), Linear
weights in a GGML block type (Q8_0, Q4_0/Q5_0, Q4_K/Q5_K/Q6_K, ...: each row cut into blocks of
32 or 256 values sharing a scale) or F16/BF16, and small tensors (norms, biases) in F32; its
`general.architecture` names the model ("flux", "wan", ...). Its tensors are read as diffusers'
`load_gguf_checkpoint` reads them (a quantized tensor is diffusers' `GGUFParameter`, its bytes
with its type, which keeps the type through the families' name maps' splits and concatenations
along rows), but tensor by tensor from the header's offsets (`read_gguf_tensors`), so that a
pipeline stage reads its own (`dpipe.models.single_file_weights.GGUFWeights`); diffusers defines
the GGUF Linear peft wraps (`GGUFLinear`).

`GGUFStoredLinear` changes what diffusers' Linear does at each matmul in two ways: it dequantizes
through fp32, where diffusers' CPU path multiplies the block scales in fp16 (~5e-4 relative
error: its weights differ from `gguf.quants.dequantize`'s), and its backward dequantizes again
instead of keeping the dequantized weight for the input's gradient (autograd would hold one
compute-dtype copy of every Linear of a stage between its forward and backward).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dpipe.errors import ModelLoadError

log = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
# `general.architecture` of the image and video models city96's tools convert, and of the text
# encoders they convert (ComfyUI-GGUF's loader.py lists both), and `minimax_h3`, which MiniMax
# H3's community GGUFs carry: a file of one of them that the family does not read is named as
# such.
KNOWN_IMAGE_ARCHITECTURES = ("flux", "sd1", "sdxl", "sd3", "aura", "hidream", "cosmos", "ltxv",
                             "hyvid", "wan", "lumina2", "qwen_image", "minimax_h3")
TEXT_ARCHITECTURES = ("t5", "t5encoder", "llama", "qwen2vl", "qwen3", "qwen3vl", "gemma3")


def architecture(file: Path) -> str | None:
    """The file's `general.architecture`, None where it has none."""
    from gguf import GGUFReader

    field = GGUFReader(str(file)).fields.get("general.architecture")
    return None if field is None else str(field.contents())


def read_gguf(file: Path, title: str, architectures: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The tensors of `file`, quantized ones as diffusers' `GGUFParameter`, F16/F32 ones as
    tensors (as diffusers' `load_gguf_checkpoint` reads them); refuses a file whose architecture
    is another model's (`architectures`: the names the family's files carry)."""
    check_architecture(file, title, architectures)
    header = gguf_header(file)
    return read_gguf_tensors(file, header, header)


def check_architecture(file: Path, title: str, architectures: tuple[str, ...]) -> None:
    """Refuses a GGUF text encoder, or a transformer of an architecture the family does not
    read."""
    arch = architecture(file)
    if arch in TEXT_ARCHITECTURES:
        raise ModelLoadError(f"{file} is a GGUF text encoder ({arch}), not a {title} transformer:"
                             " give the transformer's GGUF as model.path")
    if arch in KNOWN_IMAGE_ARCHITECTURES and arch not in architectures:
        raise ModelLoadError(
            f"{file} is a GGUF of another architecture ({arch!r} in general.architecture), not a "
            f"{title} transformer ({' or '.join(map(repr, architectures))})")


def gguf_header(file: Path) -> dict[str, dict]:
    """{tensor: its entry} of a GGUF file, none of its tensors read: its GGML `type`, the
    `shape` and torch `dtype` its data is read as (a block type's rows as bytes, as the `gguf`
    package's reader lays them out), its number of `values`, and the file offsets of its bytes
    (`data_offsets`)."""
    import numpy as np
    from gguf import GGUFReader

    return {t.name: {"type": t.tensor_type, "shape": tuple(t.data.shape),
                     "dtype": torch.from_numpy(np.empty(0, t.data.dtype)).dtype,
                     "values": int(t.n_elements),
                     "data_offsets": (t.data_offset, t.data_offset + t.n_bytes)}
            for t in GGUFReader(str(file)).tensors}


def stored_value_bytes(file: Path) -> float:
    """Bytes a value of the GGUF file's 2-D weights takes as a LoRA run keeps them: a block
    type's as stored (Q8_0 34 bytes a 32-value block, Q4_K 144 a 256-value one; the Linears
    keep them), F32 / F16 ones in bf16, 2. From the header alone."""
    from gguf import GGMLQuantizationType

    stored = values = 0
    for key, entry in gguf_header(file).items():
        if not key.endswith(".weight") or len(entry["shape"]) != 2:
            continue
        begin, end = entry["data_offsets"]
        plain = entry["type"] in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
        stored += 2 * entry["values"] if plain else end - begin
        values += entry["values"]
    return stored / values if values else 2.0


def read_gguf_tensors(file: Path, header: dict[str, dict], keys) -> dict[str, torch.Tensor]:
    """The GGUF tensors `keys` of `file` (`header`: its `gguf_header`), each read on its own
    with plain file reads, not mapped (a mapped file's pages count in the process's memory
    while it stays open)."""
    out = {}
    with open(file, "rb") as f:
        for key in sorted(keys, key=lambda k: header[k]["data_offsets"][0]):
            entry = header[key]
            begin, end = entry["data_offsets"]
            raw = torch.empty(end - begin, dtype=torch.uint8)
            f.seek(begin)
            f.readinto(memoryview(raw.numpy()))
            out[key] = as_read(raw.view(entry["dtype"]).reshape(entry["shape"]), entry, key)
    return out


def as_read(data: torch.Tensor, entry: dict, key: str) -> torch.Tensor:
    """A GGUF tensor's `data` as diffusers' loader gives it: a `GGUFParameter` of its block
    type, or as it is for F32 and F16; a block type diffusers cannot dequantize is refused."""
    from gguf import GGMLQuantizationType

    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES, GGUFParameter

    quant_type = entry["type"]
    if quant_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return data
    if quant_type not in SUPPORTED_GGUF_QUANT_TYPES:
        raise ModelLoadError(f"{key} is stored as {quant_type.name}, which diffusers does not "
                             "dequantize: use a file of another quantization")
    return GGUFParameter(data, quant_type=quant_type)


def is_gguf_quantized(value: torch.Tensor) -> bool:
    from diffusers.quantizers.gguf.utils import GGUFParameter

    return isinstance(value, GGUFParameter)


def dequantize(weight: torch.Tensor, quant_type, dtype: torch.dtype) -> torch.Tensor:
    """The values of GGUF `weight` (its bytes, of `quant_type`) in `dtype`, computed in fp32 as
    `gguf.quants.dequantize` computes them."""
    from diffusers.quantizers.gguf.utils import (GGML_QUANT_SIZES, _quant_shape_from_byte_shape,
                                                 dequantize_functions)

    block_size, type_size = GGML_QUANT_SIZES[quant_type]
    data = weight.as_tensor() if hasattr(weight, "as_tensor") else weight
    data = data.view(torch.uint8)
    blocks = data.reshape(-1, type_size)
    values = dequantize_functions[quant_type](blocks, block_size, type_size, dtype=torch.float32)
    shape = _quant_shape_from_byte_shape(data.shape, type_size, block_size)
    return values.reshape(shape).to(dtype)


# A custom op with its own backward, as dpipe.train.fp8's matmul and for its reason: compiled
# inside a block, an autograd.Function had its dequantized weights saved for backward: a
# compute-dtype copy of every weight held. The block type travels as its GGML number.
@torch.library.custom_op("dpipe::gguf_matmul", mutates_args=())
def gguf_matmul(x: torch.Tensor, data: torch.Tensor, quant_type: int,
                dtype: torch.dtype) -> torch.Tensor:
    """x @ W^T in `dtype`, W dequantized from its GGUF blocks (`data`: their bytes, rows by
    bytes); saves only the bytes for backward (the weight is frozen)."""
    return F.linear(x.to(dtype), dequantize(data, _ggml_type(quant_type), dtype))


@gguf_matmul.register_fake
def _(x, data, quant_type, dtype):
    return x.new_empty((*x.shape[:-1], data.shape[0]), dtype=dtype)


@torch.library.custom_op("dpipe::gguf_matmul_input_grad", mutates_args=())
def gguf_matmul_input_grad(grad: torch.Tensor, data: torch.Tensor, quant_type: int,
                           dtype: torch.dtype) -> torch.Tensor:
    return grad.to(dtype) @ dequantize(data, _ggml_type(quant_type), dtype)


@gguf_matmul_input_grad.register_fake
def _(grad, data, quant_type, dtype):
    from diffusers.quantizers.gguf.utils import GGML_QUANT_SIZES

    block_size, type_size = GGML_QUANT_SIZES[_ggml_type(quant_type)]
    return grad.new_empty((*grad.shape[:-1], data.shape[-1] // type_size * block_size),
                          dtype=dtype)


def _setup_context(ctx, inputs, output):
    x, data, quant_type, dtype = inputs
    ctx.save_for_backward(data)
    ctx.quant_type, ctx.dtype, ctx.x_dtype = quant_type, dtype, x.dtype


def _backward(ctx, grad):
    (data,) = ctx.saved_tensors
    x_grad = gguf_matmul_input_grad(grad, data, ctx.quant_type, ctx.dtype)
    return x_grad.to(ctx.x_dtype), None, None, None


gguf_matmul.register_autograd(_backward, setup_context=_setup_context)


def _ggml_type(number: int):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(number)


def _gguf_linear_class():
    from diffusers.quantizers.gguf.utils import GGUFLinear

    class GGUFStoredLinear(GGUFLinear):
        """diffusers' GGUFLinear, multiplying as this module's docstring says. The weight is the
        file's bytes as a plain frozen uint8 Parameter and its block type an attribute: a
        `GGUFParameter` (a tensor subclass) broke torch.compile's backward."""

        def __init__(self, linear: nn.Linear, stored: torch.Size, quant_type):
            nn.Module.__init__(self)
            self.in_features, self.out_features = linear.in_features, linear.out_features
            self.quant_type = quant_type
            self.compute_dtype = None  # the input's (or autocast's) dtype, as an nn.Linear's
            self.device = None
            # A placeholder of the stored bytes' shape: load_state_dict(assign=True) puts the
            # file's parameter here.
            self.weight = nn.Parameter(torch.empty(stored, dtype=torch.uint8, device="meta"),
                                       requires_grad=False)
            self.bias = (None if linear.bias is None else
                         nn.Parameter(torch.empty_like(linear.bias, device="meta"),
                                      requires_grad=False))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            device = x.device.type
            dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                     else x.dtype)
            y = gguf_matmul(x, self.weight, int(self.quant_type), dtype)
            return y if self.bias is None else y + self.bias.to(dtype)

        def dequantized(self) -> torch.Tensor:
            """The weight as the matmul sees it (fp32)."""
            return dequantize(self.weight, self.quant_type, torch.float32)

        def extra_repr(self) -> str:
            return (f"in_features={self.in_features}, out_features={self.out_features}, "
                    f"{self.quant_type.name}")

    return GGUFStoredLinear


_GGUFStoredLinear = None


def gguf_linear_class():
    """The GGUF Linear class (built on first use: diffusers' GGUF module imports `gguf`)."""
    global _GGUFStoredLinear
    if _GGUFStoredLinear is None:
        _GGUFStoredLinear = _gguf_linear_class()
    return _GGUFStoredLinear


def keep_quantized(model: nn.Module, state: dict[str, torch.Tensor], file: Path,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Puts a GGUF Linear in `model` wherever `state` holds a quantized Linear weight
    (`quantized_linears`); returns `state` with those Linears' bytes as plain tensors and the
    quantized tensors that no Linear takes (convolutions, embeddings, norms stored in BF16)
    dequantized to `dtype`."""
    taken = quantized_linears(model, state, file)
    return {key: value.as_tensor() if key in taken
            else dequantize(value, value.quant_type, dtype) if is_gguf_quantized(value)
            else value for key, value in state.items()}


def quantized_linears(model: nn.Module, state: dict[str, torch.Tensor], file: Path) -> set[str]:
    """Puts a GGUF Linear in `model` (built on the meta device) wherever `state` (diffusers'
    names; the file's tensors, or meta tensors of their shapes and types) holds a quantized
    Linear weight, after checking its shape is the Linear's; returns the names of those
    weights."""
    linear_class = gguf_linear_class()
    taken = set()
    for name, module in list(model.named_modules()):
        key = f"{name}.weight"
        if type(module) is not nn.Linear or not is_gguf_quantized(state.get(key)):
            continue
        weight = state[key]
        if tuple(weight.quant_shape) != (module.out_features, module.in_features):
            raise ModelLoadError(
                f"{file}: {key} holds a {tuple(weight.quant_shape)} {weight.quant_type.name} "
                f"weight where the model has a ({module.out_features}, {module.in_features}) "
                "Linear: not a checkpoint of this model's size")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                linear_class(module, weight.shape, weight.quant_type))
        taken.add(key)
    if taken:
        kinds = sorted({state[k].quant_type.name for k in taken})
        stored = sum(state[k].numel() for k in taken)  # bytes: the tensors are uint8
        values = sum(math.prod(state[k].quant_shape) for k in taken)
        log.info("%s: %d Linears kept quantized (%s): %.1f MiB as stored, %.1f MiB in bf16",
                 file, len(taken), ", ".join(kinds), stored / 2 ** 20, 2 * values / 2 ** 20)
    return taken


def write_gguf_copy(file: Path, out: Path, quant_type: str, arch: str) -> Path:
    """`file` (a plain single file) as the GGUF `out`, as city96's convert tool lays one out: the
    names without ComfyUI's prefix (or NVIDIA's `net.`), each 2-D `.weight` whose rows split into
    `quant_type`'s blocks ("Q8_0", "Q4_K", ...) quantized by the `gguf` package's own quantizer,
    the rest in F32; `general.architecture` = `arch`. The tiny models' GGUF files, for tests
    (their rows are 32-256 wide: K-quants, of 256-value blocks, apply to few of them)."""
    import gguf
    from safetensors.torch import load_file

    qtype = gguf.GGMLQuantizationType[quant_type]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    writer = gguf.GGUFWriter(str(out), arch=arch)
    for key, value in load_file(str(file)).items():
        name = key.removeprefix("model.diffusion_model.").removeprefix("net.")
        array = value.to(torch.float32).numpy()
        if key.endswith(".weight") and value.dim() == 2 and value.shape[1] % block == 0:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def with_plain_linears(model: nn.Module) -> nn.Module:
    """`model` with each GGUF Linear replaced by an nn.Linear of its fp32 values, for diffusers'
    LoRA loading (whose FLUX loader takes a Linear's weight shape for its size, and the file's
    bytes are not that); the same numbers, in fp32's memory."""
    linear_class = gguf_linear_class()
    for name, module in list(model.named_modules()):
        if not isinstance(module, linear_class):
            continue
        plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                          device="meta")
        plain.weight = nn.Parameter(module.dequantized(), requires_grad=False)
        if module.bias is not None:
            plain.bias = nn.Parameter(module.bias.detach().float(), requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, plain)
    return model
