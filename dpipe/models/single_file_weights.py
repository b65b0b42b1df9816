"""A single-file transformer's weights for one pipeline stage (`FileWeights`, a source of
`dpipe.models.stage_weights.DenoiserSkeleton`): the tensors of the file that the stage's
parameters come from, read one by one, converted to diffusers' names by the family's own
converter and cast to the dtype training keeps each in.

A family's converter (`from_single_file`) maps a whole state dict: it renames, splits fused
Linears, stacks, swaps halves. Run once on the file's header alone, as meta tensors that carry
the names of the file's tensors they were made from (`_Traced`), it tells which of the file's
tensors each diffusers weight comes from. A stage then reads those tensors only and runs the
same converter over them, the file's other tensors standing in as meta tensors: one converter,
and the values exactly those of the whole load.

Plain files only (float weights, safetensors): a quantized file's weights are dequantized with
their scales, and a GGUF's blocks kept quantized, by the whole load (`load_transformer_file`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from dpipe.errors import ModelLoadError
from dpipe.models.safetensors_files import TENSOR_DTYPES, file_header, read_tensors
from dpipe.models.single_file import check_names, converter_name
from dpipe.models.stage_weights import DenoiserSkeleton, empty_model, skeleton_of

# The suffixes of safetensors files among single files (Wan's releases use .sft).
SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
# The float dtypes a plain file stores its weights in.
PLAIN_DTYPES = ("F32", "F16", "BF16")
# The file's tensors read before each run of the converter: about this many bytes, and the
# tensors they are joined to. A batch and its converted copies (a fused tensor's parts, cloned)
# stay within the largest layer that `dpipe.pipeline.memory.loading_bytes` counts in transit
# at FLUX.1-dev's size (0.5 GiB against a double block's 0.68 GiB in bf16); the converter's
# run over the other tensors, as meta tensors, takes ~4 ms there.
BATCH_BYTES = 128 << 20


def reads_by_tensor(file: Path) -> bool:
    """Whether a stage can read `file` tensor by tensor: a safetensors file of float weights with
    no quantization markers (scales, comfy_quant layouts). A file not there yet (a plan made
    before the download) counts as the plain release it is named as."""
    from dpipe.models.common.comfy_quant import CONF, HEADER_KEY
    from dpipe.models.common.quantized_files import is_quantization_key

    if file.suffix not in SAFETENSORS_SUFFIXES:
        return False
    if not file.is_file():
        return True
    header, metadata = file_header(file)
    return HEADER_KEY not in metadata and not any(
        is_quantization_key(key) or key.endswith(CONF) or
        (entry["dtype"] not in PLAIN_DTYPES and key.endswith(".weight"))
        for key, entry in header.items())


class _Traced(torch.Tensor):
    """A meta tensor that carries the names of the file's tensors it was made from; every
    operation on it passes them on to what it makes (and, in place, to its target)."""

    sources: frozenset[str]

    @staticmethod
    def make(tensor: torch.Tensor, sources: frozenset[str]) -> "_Traced":
        traced = tensor.as_subclass(_Traced)
        traced.sources = sources
        return traced

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_flatten((args, kwargs))[0]
        sources = frozenset().union(*(x.sources for x in leaves if isinstance(x, _Traced)))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if (name.endswith("_") or name == "__setitem__") and isinstance(args[0], _Traced):
            args[0].sources = args[0].sources | sources  # in place: into the target

        def traced(t):
            return (_Traced.make(t, sources)
                    if isinstance(t, torch.Tensor) and not isinstance(t, _Traced) else t)

        if isinstance(out, (tuple, list)) and not isinstance(out, torch.Size):  # split, chunk
            return type(out)(traced(t) for t in out)
        return traced(out)


class FileWeights:
    """The weights of one single file in the original layout, under diffusers' names: `convert`
    (the family's `from_single_file(state, model)`, None for a file in diffusers' names) maps
    the file's names, stripped of ComfyUI's prefix, as the whole load maps them."""

    def __init__(self, file: Path, model: nn.Module, convert: Callable | None, title: str):
        self.file, self.model, self.convert, self.title = file, model, convert, title
        self.stored, _ = file_header(file)
        # The file's names as the converter sees them -> the file's own.
        self.names = {converter_name(key): key for key in self.stored}
        converted = self._converted({name: _Traced.make(self._meta(key), frozenset((key,)))
                                     for name, key in self.names.items()})
        everything = frozenset(self.stored)
        # A weight the converter made by other means than torch's operations: the whole file.
        self.sources = {name: value.sources if isinstance(value, _Traced) else everything
                        for name, value in converted.items()}
        check_names(file, title, set(model.state_dict()), set(converted))

    def _meta(self, key: str) -> torch.Tensor:
        """The file's tensor `key` as a meta tensor of its shape and stored dtype."""
        entry = self.stored[key]
        return torch.empty(entry["shape"], dtype=TENSOR_DTYPES[entry["dtype"]], device="meta")

    def _converted(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.convert is None:
            return state
        try:
            return self.convert(state, self.model)
        except (KeyError, RuntimeError, ValueError) as err:  # names or sizes of another model
            raise ModelLoadError(
                f"{self.file} is not a {self.title} checkpoint in the layout dpipe reads "
                f"(converting its names failed: {err!r})") from None

    def holds(self, name: str) -> bool:
        return name in self.sources

    def missing(self, name: str) -> str:
        return f"{self.file} holds no weight for {name}"

    def read(self, wanted: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """The `wanted` weights, a batch of the file's tensors at a time (about BATCH_BYTES):
        each batch read in its stored dtype, converted with the file's other tensors as meta
        tensors, then cast."""
        out: dict[str, torch.Tensor] = {}
        for names, keys in self._batches(wanted):
            real = read_tensors(self.file, {key: TENSOR_DTYPES[self.stored[key]["dtype"]]
                                            for key in keys})
            state = {name: real[key] if key in real else self._meta(key)
                     for name, key in self.names.items()}
            converted = self._converted(state)
            for name in names:
                value = converted[name].to(wanted[name])
                # A part of a fused tensor would keep all of it: its own storage instead.
                whole = value.untyped_storage().nbytes() > value.numel() * value.element_size()
                out[name] = value.clone() if whole else value
            del real, state, converted
        return out

    def _batches(self, wanted: dict[str, torch.dtype]):
        """(diffusers names, the file's tensors they need), in the file's order, each batch
        closed: every weight made from a tensor it reads is made from tensors it reads alone,
        so the converter never joins a read tensor to a meta one."""
        users: dict[str, list[str]] = {}
        for name, sources in self.sources.items():
            for key in sources:
                users.setdefault(key, []).append(name)
        done: set[str] = set()
        order = sorted(wanted, key=lambda n: min(
            (self.stored[k]["data_offsets"][0] for k in self.sources[n]), default=0))
        batch_names: list[str] = []
        batch_keys: set[str] = set()
        size = 0
        for first in order:
            if first in done:
                continue
            names, keys, todo = set(), set(), [first]
            while todo:  # the weights joined to `first` through a tensor of the file
                name = todo.pop()
                if name in names:
                    continue
                names.add(name)
                for key in self.sources[name] - keys:
                    keys.add(key)
                    todo.extend(users[key])
            done |= names
            batch_names += [n for n in names if n in wanted]
            batch_keys |= keys
            size += sum(_nbytes(self.stored[k]) for k in keys)
            if size >= BATCH_BYTES:
                yield batch_names, batch_keys
                batch_names, batch_keys, size = [], set(), 0
        if batch_names:
            yield batch_names, batch_keys


def _nbytes(entry: dict) -> int:
    begin, end = entry["data_offsets"]
    return end - begin


def file_skeleton(model_cls, config_dir: Path, file: Path, convert: Callable | None,
                  title: str) -> DenoiserSkeleton | None:
    """The denoiser of `config_dir`'s config, its weights to be read from the single file
    `file` stage by stage; None where the file is not a plain safetensors file
    (`reads_by_tensor`): the whole load reads it."""
    if not reads_by_tensor(file):
        return None
    model = empty_model(model_cls, config_dir)
    return skeleton_of(model, FileWeights(file, model, convert, title))
