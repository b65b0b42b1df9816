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

A quantized file (ComfyUI's scaled fp8, int8 with scales, comfy_quant layers) is read the same
way: a stage reads its weights with their scales and comfy_quant entries, and the layout's own
rules (`dpipe.models.single_file.dequantized_state`) run over them, the file's other tensors
meta, before the converter; a LoRA's frozen base keeps each Linear's stored form
(`comfy_quant.StoredForm`, from the row tables the converter maps as the whole load maps them).

A GGUF file (`GGUFWeights`) is read the same way from its header's offsets, its quantized
tensors as diffusers' `GGUFParameter`s (a stand-in is one on the meta device), which the
converter moves whole as in the whole load: the Linears whose weights come out quantized become
GGUF Linears before any adapter wraps them (learnt from the converter's run over the stand-ins)
and take the file's blocks as they are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from dpipe.models.common.comfy_quant import CONF, StoredForm, stored_form
from dpipe.models.common.gguf_files import (GGUF_SUFFIX, as_read, check_architecture,
                                            dequantize, gguf_header, is_gguf_quantized,
                                            quantized_linears, read_gguf_tensors)
from dpipe.models.common.quantized_files import MARKER
from dpipe.models.safetensors_files import TENSOR_DTYPES, file_header, read_tensors
from dpipe.models.single_file import (check_names, converted_or_refused, converter_name,
                                      dequantized_state, mapped_tables)
from dpipe.models.stage_weights import DenoiserSkeleton, empty_model, skeleton_of

# The suffixes of safetensors files among single files (Wan's releases use .sft).
SAFETENSORS_SUFFIXES = (".safetensors", ".sft")
# The 8-bit dtypes of quantized files' weights (nvfp4 packs two values a byte), as a batch
# counts them: their fp32 values and the converter's copies, 8 (16) bytes a stored byte. Stage 0
# of 2 of a bf16 LoRA of a 146M-parameter FLUX-style denoiser from its fp8_scaled file rose
# 219 MB so (315 MB at 4 bytes; its plain file 212 MB; the plan's bound 272 MB).
VALUE_BYTES = {"F8_E4M3": 8, "F8_E5M2": 8, "I8": 8, "U8": 16}
# The file's tensors read before each run of the converter: about this many bytes, and the
# tensors they are joined to. A batch and its converted copies (a fused tensor's parts, cloned)
# stay within the largest layer that `dpipe.pipeline.memory.loading_bytes` counts in transit
# at FLUX.1-dev's size (0.5 GiB against a double block's 0.68 GiB in bf16); the converter's
# run over the other tensors, as meta tensors, takes ~4 ms there.
BATCH_BYTES = 128 << 20


def reads_by_tensor(file: Path) -> bool:
    """Whether a stage can read `file` tensor by tensor: a safetensors file, plain or in one of
    the quantization layouts dpipe reads (a layout it does not read is refused with the whole
    load's message as the stage's weights are set up), or a GGUF file."""
    return file.suffix in (*SAFETENSORS_SUFFIXES, GGUF_SUFFIX)


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
    the file's names, stripped of ComfyUI's prefix, as the whole load maps them. `keep_stored`:
    the Linears of a quantized file also keep their stored form (`stored_forms`, filled as
    they are read), as `load_transformer_file(keep_stored=True)` keeps it."""

    def __init__(self, file: Path, model: nn.Module, convert: Callable | None, title: str,
                 keep_stored: bool = False):
        self.file, self.model, self.convert, self.title = file, model, convert, title
        self.stored, self.metadata, self.confs = self._header()
        self.stored_forms: dict[str, StoredForm] = {}
        values, tables = self._values({key: _Traced.make(self._meta(key), frozenset((key,)))
                                       for key in self.stored})
        # What the converter sees of the tensors a batch does not read: meta tensors of the
        # whole load's shapes and dtypes, values and row tables (the layout's rules run over
        # the batch's tensors alone), and the markers those rules look for.
        self.stand_ins, self.table_stand_ins = ({name: _plain_meta(v) for name, v in d.items()}
                                                for d in (values, tables))
        self.markers = {key: self._meta(key) for key in self.stored
                        if key.rsplit(".", 1)[-1] == MARKER}
        converted = self._converted(values)
        everything = frozenset(self.stored)
        # A weight the converter made by other means than torch's operations: the whole file.
        self.sources = {name: value.sources if isinstance(value, _Traced) else everything
                        for name, value in converted.items()}
        check_names(file, title, set(model.state_dict()), set(converted))
        # The Linears whose stored form is kept: their row tables pass the converter.
        self.tabled: set[str] = set()
        if keep_stored and tables:
            linears = {f"{n}.weight" for n, m in model.named_modules() if type(m) is nn.Linear}
            mapped = self._tables(values, tables)
            self.tabled = {n for n, t in mapped.items() if t.dtype == torch.float64
                           and n in linears}
            for name in self.tabled:
                self.sources[name] = self.sources[name] | getattr(mapped[name], "sources",
                                                                  everything)

    def _header(self) -> tuple[dict[str, dict], dict[str, str], dict[str, torch.Tensor]]:
        """(the file's header entries, its metadata, comfy_quant's per-layer JSON, which the
        layout's rules read: a few bytes a layer)."""
        stored, metadata = file_header(self.file)
        return stored, metadata, read_tensors(self.file, {k: torch.uint8 for k in stored
                                                          if k.endswith(CONF)})

    def _read(self, keys: set[str]) -> dict[str, torch.Tensor]:
        """The file's tensors `keys`, each as stored."""
        return read_tensors(self.file, {key: TENSOR_DTYPES[self.stored[key]["dtype"]]
                                        for key in keys})

    def _kept(self, name: str, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The converted weight `name` as the stage keeps it: cast to `dtype`."""
        return value.to(dtype)

    def _values(self, state: dict[str, torch.Tensor], part: bool = False
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The file's tensors `state` as the converter takes them: dequantized in fp32 by the
        file's layout (as the whole load reads them), with their row tables; each under the
        converter's name. `part`: some of the file's weights, with their scales."""
        values, tables = dequantized_state({**state, **self.confs}, self.metadata, self.file,
                                           torch.float32, part=part)
        return ({converter_name(k): v for k, v in values.items()},
                {converter_name(k): v for k, v in tables.items()})

    def _tables(self, values: dict[str, torch.Tensor], tables: dict[str, torch.Tensor]
                ) -> dict[str, torch.Tensor]:
        """The row tables under diffusers' names, mapped as the whole load maps them."""
        if self.convert is None:
            return tables
        return mapped_tables(self.convert, {**values, **tables}, self.model, self.file)

    def _meta(self, key: str) -> torch.Tensor:
        """The file's tensor `key` as a meta tensor of its shape and stored dtype."""
        entry = self.stored[key]
        return torch.empty(entry["shape"], dtype=TENSOR_DTYPES[entry["dtype"]], device="meta")

    def _converted(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.convert is None:
            return state
        return converted_or_refused(self.convert, state, self.model, self.file, self.title)

    def holds(self, name: str) -> bool:
        return name in self.sources

    def missing(self, name: str) -> str:
        return f"{self.file} holds no weight for {name}"

    def read(self, wanted: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """The `wanted` weights, a batch of the file's tensors at a time (about BATCH_BYTES):
        each batch read in its stored dtype, dequantized and converted with the file's other
        tensors as meta tensors, then cast; the stored forms of its Linears kept where asked."""
        out: dict[str, torch.Tensor] = {}
        for names, keys in self._batches(wanted):
            real = self._read(keys)
            read, tables = self._values({**self.markers, **real}, part=True)
            values = {name: read.get(name, meta) for name, meta in self.stand_ins.items()}
            converted = self._converted(values)
            mapped = (self._tables(values, {**self.table_stand_ins, **tables})
                      if self.tabled & set(names) else {})
            for name in names:
                form = (stored_form(converted[name].detach(), mapped[name])
                        if name in self.tabled else None)
                if form is not None:  # kept once: the weight's values come back from it
                    form.weight_elided = True
                    self.stored_forms[name] = form
                    out[name] = torch.zeros((), dtype=wanted[name]).expand(form.values.shape)
                    continue
                value = self._kept(name, converted[name], wanted[name])
                # A part of a fused tensor would keep all of it: its own storage instead.
                whole = value.untyped_storage().nbytes() > value.numel() * value.element_size()
                out[name] = value.clone() if whole else value
            del real, read, values, tables, converted, mapped
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
            size += sum(_read_bytes(self.stored[k]) for k in keys)
            if size >= BATCH_BYTES:
                yield batch_names, batch_keys
                batch_names, batch_keys, size = [], set(), 0
        if batch_names:
            yield batch_names, batch_keys


class GGUFWeights(FileWeights):
    """The weights of one GGUF file (its names the original layout's, as `FileWeights`'), its
    Linears' quantized weights kept in their blocks as `load_transformer_file` keeps them: the
    model's Linears that take them become GGUF Linears as this source is made."""

    def __init__(self, file: Path, model: nn.Module, convert: Callable | None, title: str,
                 architectures: tuple[str, ...], family_title: str | None = None):
        # A file of another architecture is named against the family's title (`family_title`:
        # "FLUX.1"), as the whole load's `read_gguf` names it; the names' checks say `title`.
        check_architecture(file, family_title or title, architectures)
        super().__init__(file, model, convert, title)
        # What the converter sees of a tensor a batch does not read: the whole load's tensor,
        # a `GGUFParameter` of its block type, on the meta device; their converted forms
        # say which Linears keep blocks.
        self.stand_ins = {converter_name(key): as_read(self._meta(key), entry, key)
                          for key, entry in self.stored.items()}
        self.quantized = quantized_linears(model, self._converted(self.stand_ins), file)

    def _header(self) -> tuple[dict[str, dict], dict[str, str], dict[str, torch.Tensor]]:
        return gguf_header(self.file), {}, {}

    def _meta(self, key: str) -> torch.Tensor:
        entry = self.stored[key]
        return torch.empty(entry["shape"], dtype=entry["dtype"], device="meta")

    def _read(self, keys: set[str]) -> dict[str, torch.Tensor]:
        return read_gguf_tensors(self.file, self.stored, keys)

    def _values(self, state: dict[str, torch.Tensor], part: bool = False
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return {converter_name(k): v for k, v in state.items()}, {}  # no layout's rules

    def _kept(self, name: str, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A GGUF Linear's weight: its blocks as stored. Another quantized tensor: dequantized
        in fp32 (as the whole load reads it), then cast to `dtype`."""
        if name in self.quantized:
            return value.as_tensor()
        if is_gguf_quantized(value):
            return dequantize(value, value.quant_type, torch.float32).to(dtype)
        return value.to(dtype)


def file_weights(file: Path, model: nn.Module, convert: Callable | None, title: str,
                 keep_stored: bool = False, gguf_architectures: tuple[str, ...] = (),
                 family_title: str | None = None) -> FileWeights:
    """The source of the single file `file`'s weights: `GGUFWeights` for a GGUF file (of one of
    the family's `gguf_architectures`; another is refused naming `family_title`), else
    `FileWeights` (`keep_stored`: see there)."""
    if file.suffix == GGUF_SUFFIX:
        return GGUFWeights(file, model, convert, title, gguf_architectures, family_title)
    return FileWeights(file, model, convert, title, keep_stored)


def _plain_meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def _read_bytes(entry: dict) -> int:
    """The bytes a file tensor takes once read: its values in fp32 where it is quantized (a
    GGUF's entries name torch dtypes: as stored, its blocks staying blocks)."""
    begin, end = entry["data_offsets"]
    return (end - begin) * VALUE_BYTES.get(entry["dtype"], 1)


def file_skeleton(model_cls, config_dir: Path, file: Path, convert: Callable | None,
                  title: str, keep_stored: bool = False,
                  gguf_architectures: tuple[str, ...] = (),
                  family_title: str | None = None) -> DenoiserSkeleton | None:
    """The denoiser of `config_dir`'s config, its weights to be read from the single file
    `file` stage by stage (`file_weights`); None where the file is neither a safetensors nor a
    GGUF file (`reads_by_tensor`): the whole load reads it."""
    if not reads_by_tensor(file):
        return None
    model = empty_model(model_cls, config_dir)
    return skeleton_of(model, file_weights(file, model, convert, title, keep_stored,
                                           gguf_architectures, family_title))
