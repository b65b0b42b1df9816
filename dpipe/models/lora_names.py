"""Where each module of a LoRA file in another format goes among the family's diffusers modules,
learnt from the family's own writers, so that writing and reading are one table.

A family writes its ComfyUI (or kohya) LoRA through `lora_formats`: a linear map from diffusers
(A, B) pairs to the format's pairs that renames modules, stacks several into one fused weight
(A rows stacked, B block-diagonal) and may reorder a weight's output rows. Writing a probe LoRA
of rank 1 through it, each module's A filled with the module's number and its B with its row
numbers (1, 2, ...), shows every format module's parts: which diffusers module each A row came
from, and at which rows of the format module each of that module's rows landed. Reading inverts
exactly that (`dpipe.models.lora_read`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

# A LoRA file's key: <module>.<part>, the part in any of the names the tools write.
KEY = re.compile(
    r"^(?P<module>.+?)\.(?P<part>lora_[AB](?:\.default)?\.weight|lora_(?:down|up|mid)\.weight"
    r"|alpha|dora_scale|diff|diff_b|lora_magnitude_vector(?:\.default)?(?:\.weight)?"
    r"|lokr_w[12](?:_[ab])?(?:\.default)?|lokr_t2|hada_w[12]_[ab](?:\.default)?|hada_t[12])$")
# Each tool's part names as peft's (diffusers' files keep peft's, without the adapter name).
PART_NAMES = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight",
              "lora_magnitude_vector.weight": "lora_magnitude_vector"}


def split_key(key: str) -> tuple[str, str] | None:
    """(module, part under peft's name) of a LoRA file's key, None for a key of no known part."""
    match = KEY.match(key)
    if match is None:
        return None
    part = match["part"].replace(".default", "")
    return match["module"], PART_NAMES.get(part, part)


def flat(name: str) -> str:
    """A module name as kohya-style tools write it (dots as underscores): names compare this
    way when a file's are of that kind."""
    return name.replace(".", "_")


@dataclass(frozen=True)
class Part:
    """One diffusers module's share of a format module: rows `file_rows` of the format module's
    weight are the diffusers module's rows `rows`; the module is part `index` of the `parts`
    the writer stacks along the format module's rank (A's rows)."""

    module: str
    file_rows: torch.Tensor
    rows: torch.Tensor
    index: int
    parts: int

    @property
    def whole(self) -> bool:
        """The format module is this diffusers module, row for row."""
        return self.parts == 1 and torch.equal(self.file_rows, self.rows)


class LoraNames:
    """The family's module names: its diffusers modules (with their weight shapes) and the
    modules of each format it writes, as lists of `Part`s."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], formats: dict[str, list[Part]]):
        self.shapes = shapes
        self.diffusers = {m: [Part(m, torch.arange(s[0]), torch.arange(s[0]), 0, 1)]
                          for m, s in shapes.items()}
        self.formats = formats

    def place(self, name: str, format_first: bool) -> list[Part] | None:
        """The parts of a file's module `name` (its prefix removed), looked up as written, then
        with dots as underscores; in the format's names first for files in a format's names."""
        tables = [self.formats, self.diffusers]
        if not format_first:
            tables.reverse()
        for table in tables:
            if name in table:
                return table[name]
        for table in tables:
            found = _flat_index(table).get(flat(name))
            if found is not None:
                return found
        return None


def _flat_index(table: dict[str, list[Part]]) -> dict[str, list[Part]]:
    index: dict[str, list[Part]] = {}
    for name, parts in table.items():
        index.setdefault(flat(name), parts)
    return index


# The layers a LoRA file may adapt: Linears, and convolutions (LyCORIS's LoCon, kohya's conv LoRA).
ADAPTABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def layer_shapes(denoiser: nn.Module) -> dict[str, tuple[int, ...]]:
    """{module: weight shape} of the denoiser's Linear and convolution layers, under their plain
    names (an adapted layer under its own, not its base layer's)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    from dpipe.models.adapters import is_adapter_param

    shapes = {}
    for name, module in denoiser.named_modules():
        if isinstance(module, BaseTunerLayer):
            base = module.get_base_layer()
            if isinstance(base, ADAPTABLE):
                shapes[name] = tuple(base.weight.shape)
        elif isinstance(module, ADAPTABLE) and not is_adapter_param(name) \
                and ".base_layer" not in f".{name}." and not name.endswith("base_layer"):
            shapes[name] = tuple(module.weight.shape)
    return shapes


def lora_names(spec, shapes: dict[str, tuple[int, ...]]) -> LoraNames:
    """The family's table for the modules `shapes` names (`layer_shapes`, or a folder's or single
    file's weight shapes), from its LoRA writers (`spec.lora_formats`). The writers learn the
    convolutions' names in a probe of their own: a writer made for Linears that refuses them
    still gives the Linears' names. A family whose single files ComfyUI renames on loading
    (`spec.comfyui_file_module`: the HunyuanVideo family's `mlp.fc1` -> `mlp.0`, ...) has its
    ComfyUI LoRAs name the renamed modules: those names place a file's modules too."""
    from dpipe.models.lora_read import strip_prefix

    linears = {m: s for m, s in shapes.items() if len(s) == 2}
    convs = {m: s for m, s in shapes.items() if len(s) > 2}
    formats: dict[str, list[Part]] = {}
    for probed in (linears, convs):
        if not probed:
            continue
        for modules in format_modules(spec.lora_formats, probed).values():
            for name, parts in modules.items():
                formats.setdefault(strip_prefix(name)[0], parts)
    renamed = getattr(spec, "comfyui_file_module", None)
    for module, shape in shapes.items() if renamed is not None else ():
        alias = renamed(module)
        if alias != module and alias not in shapes:
            rows = torch.arange(shape[0])
            formats.setdefault(alias, [Part(module, rows, rows, 0, 1)])
    return LoraNames(shapes, formats)


def format_modules(formats_of, shapes: dict[str, tuple[int, ...]]
                   ) -> dict[str, dict[str, list[Part]]]:
    """{format file: {module name as written there: its parts}} of each LoRA format that
    `formats_of(weights, metadata)` (a family's `lora_formats`) writes, for the diffusers
    modules of `shapes`, learnt from a probe written through it."""
    from dpipe.models.lora_files import NotInFormat

    modules = sorted(shapes)
    probe = {}
    for number, module in enumerate(modules, start=1):
        rows, cols = shapes[module][0], shapes[module][1]
        probe[f"{module}.lora_A.weight"] = torch.full((1, cols), float(number), dtype=torch.float64)
        probe[f"{module}.lora_B.weight"] = torch.arange(1, rows + 1, dtype=torch.float64)[:, None]
    metadata = {"r": 1, "lora_alpha": 1, "alpha": 1, "target_modules": modules}
    out = {}
    for fmt in formats_of(probe, metadata):
        try:
            tensors = fmt.build()
        except NotInFormat as err:
            tensors = err.partial
        except Exception as err:  # a writer that cannot take every Linear: its names unread
            log.debug("%s: no names learnt (%s: %s)", fmt.file, type(err).__name__, err)
            continue
        out[fmt.file] = _decoded(tensors, modules)
    return out


def _decoded(tensors: dict[str, torch.Tensor], modules: list[str]) -> dict[str, list[Part]]:
    """{format module (as written): its parts} from a probe's written tensors."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        split = split_key(key)
        if split is not None:
            grouped.setdefault(split[0], {})[split[1]] = value
    out = {}
    for raw, parts in grouped.items():
        a, b = parts.get("lora_A.weight"), parts.get("lora_B.weight")
        if a is None or b is None:
            continue
        a, b = a.double().flatten(1), b.double().flatten(1)
        found = []
        for index in range(a.shape[0]):
            number = a[index, 0].item()
            if not (a[index] == number).all() or number != int(number) \
                    or not 1 <= number <= len(modules):
                found = None
                break
            column = b[:, index]
            file_rows = column.nonzero().flatten()
            rows = column[file_rows].round().long() - 1
            found.append(Part(modules[int(number) - 1], file_rows, rows, index, a.shape[0]))
        if found:
            out[raw] = found
    return out


def base_names(spec, shapes: dict[str, tuple[int, ...]]) -> LoraNames:
    """The family's table for a base whose modules `shapes` names: `lora_names` where they are
    the diffusers modules; for a single file in the family's original names (those its
    `to_original` writes: Chroma's `double_blocks.N.img_attn.qkv`, ...), every name the family's
    table places on its diffusers modules (diffusers', each format's) carried on through that
    converter onto the file's modules and rows, so that a diffusers-named LoRA (ComfyUI applies
    Chroma's and Krea 2's by diffusers names) lands on the file's fused weights. The file's own
    names place too."""
    own = lora_names(spec, shapes)
    to_original = getattr(type(spec), "to_original", None)
    if to_original is None:
        return own
    diffusers = _diffusers_shapes(spec)
    if set(shapes) >= set(diffusers):  # the base is in diffusers' names
        return own
    moved = converted_rows(to_original, diffusers)
    if not moved:
        return own
    table = lora_names(spec, diffusers)
    formats: dict[str, list[Part]] = {}
    for source in (table.formats, table.diffusers):
        for name, parts in source.items():
            carried = _carried(parts, moved)
            if carried:
                formats.setdefault(name, carried)
    for name, parts in own.formats.items():
        formats.setdefault(name, parts)
    return LoraNames(shapes, formats)


def _diffusers_shapes(spec) -> dict[str, tuple[int, ...]]:
    """{module: weight shape} of the family's diffusers denoiser, built on the meta device from
    its config (a single file's `model.single_file_config` folder has it)."""
    from dpipe.models.family import diffusers_class
    from dpipe.models.stage_weights import empty_model

    model = empty_model(diffusers_class(spec.denoiser_class), spec.path / spec.denoiser_folder)
    return layer_shapes(model)


# A probe row's value: its module's number times this, plus its row number (from 1); exact in
# float64 for any module count and width a denoiser has.
_ROW_BASE = 2 ** 24


def converted_rows(to_original, shapes: dict[str, tuple[int, ...]]) -> dict[str, list[Part]]:
    """{diffusers module: where its rows land among the file's modules} for the converter
    `to_original` (diffusers-named weights -> the file's), learnt as `format_modules` learns a
    writer: each module's weight probed as one column, row i of module number n holding
    n * 2**24 + i + 1, which every rename, concatenation, split or reordering of rows keeps.
    Empty where the converter takes no such probe (it names what stopped it in the log)."""
    from dpipe.models.lora_tools import module_name

    modules = sorted(m for m, s in shapes.items() if len(s) == 2)
    probe = {f"{m}.weight": (n * _ROW_BASE + torch.arange(1, shapes[m][0] + 1,
                                                          dtype=torch.float64))[:, None]
             for n, m in enumerate(modules, start=1)}
    try:
        converted = to_original(probe)
    except Exception as err:  # a converter that needs the other weights: no names learnt
        log.debug("no file names learnt from %s (%s: %s)", to_original, type(err).__name__, err)
        return {}
    moved: dict[str, list[Part]] = {}
    for key, value in converted.items():
        target = module_name(key)
        if target is None or value.dtype != torch.float64 or value.dim() != 2 \
                or value.shape[1] != 1:
            continue
        value = value[:, 0]
        numbers = torch.div(value, _ROW_BASE, rounding_mode="floor").long()
        rows = (value - numbers * _ROW_BASE).long() - 1
        for number in numbers.unique().tolist():
            if not 1 <= number <= len(modules):
                continue
            at = (numbers == number).nonzero().flatten()
            moved.setdefault(modules[number - 1], []).append(
                Part(target, rows[at], at, 0, 1))
    return moved


def _carried(parts: list[Part], moved: dict[str, list[Part]]) -> list[Part] | None:
    """A format module's parts on the diffusers modules carried on to the file's modules: each
    row of the format module goes where the converter puts its diffusers row. None where a part's
    module has no place in the file."""
    out = []
    for part in parts:
        targets = moved.get(part.module)
        if targets is None:
            return None
        for target in targets:
            # target: rows target.file_rows of the diffusers module are rows target.rows of the
            # file's module; part: rows part.file_rows of the format module are the diffusers
            # module's rows part.rows.
            at = torch.full((int(target.file_rows.max()) + 1,), -1, dtype=torch.long)
            at[target.file_rows] = torch.arange(len(target.file_rows))
            inside = part.rows < len(at)
            index = torch.full_like(part.rows, -1)
            index[inside] = at[part.rows[inside]]
            kept = index >= 0
            if kept.any():
                out.append(Part(target.module, part.file_rows[kept], target.rows[index[kept]],
                                part.index, part.parts))
    return out or None
