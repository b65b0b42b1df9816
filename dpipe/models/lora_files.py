"""A LoRA in diffusers' format, which every family writes.

A trained LoRA leaves the pipeline as peft's state dict of the denoiser. Each family writes it
through its pipeline's `save_lora_weights`, so that `pipeline.load_lora_weights` reads it, and then
in its ComfyUI (or kohya) form, whose names are the family's own (`dpipe.models.comfyui`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dpipe.io import atomic_write, atomic_write_text

log = logging.getLogger(__name__)

DIFFUSERS_LORA = "pytorch_lora_weights.safetensors"  # the name save_lora_weights gives its file
EXPORTS_RECORD = "exports.json"  # which format files an export wrote, and what each left out


def save_diffusers_lora(loader, weights: dict[str, torch.Tensor], metadata: dict[str, Any],
                        out_dir: Path, component: str = "transformer") -> Path:
    """Writes diffusers-named `weights` with their adapter `metadata` through `loader` (a pipeline
    class or its LoRA loader mixin) as the LoRA of `component`; returns the file."""
    loader.save_lora_weights(out_dir, **{f"{component}_lora_layers": weights,
                                         f"{component}_lora_adapter_metadata": metadata})
    return out_dir / DIFFUSERS_LORA


def lora_metadata(cfg, default_targets) -> dict[str, Any]:
    """peft's adapter config as diffusers stores it (the keyword arguments of the adapter's peft
    config class: `LoraConfig`, with `use_dora` for DoRA, `LoKrConfig` or `LoHaConfig`): rank,
    alpha (the rank when unset), targets."""
    from dpipe.models.adapters import adapter_metadata

    return adapter_metadata(cfg, default_targets)


def lora_scale(metadata: dict[str, Any]) -> float:
    """alpha / rank: the factor peft applies to B @ A, which formats without an alpha fold into
    B."""
    return metadata.get("lora_alpha", metadata.get("alpha")) / metadata["r"]


def peft_to_diffusers(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft names carry the adapter name ("lora_A.default.weight", "lokr_w1.default");
    diffusers' format does not, and names DoRA's magnitude as peft saves it
    ("<module>.lora_magnitude_vector", no ".weight")."""
    out = {}
    for key, value in state_dict.items():
        key = key.replace(".default.", ".").removesuffix(".default")
        if key.endswith(".lora_magnitude_vector.weight"):
            key = key.removesuffix(".weight")
        out[key] = value.contiguous()
    return out


class NotInFormat(ValueError):
    """A format has no name for some LoRA modules (its original checkpoint has no such weight):
    `partial` holds the file's tensors for every other module, `modules` the ones left out."""

    def __init__(self, what: str, modules: list[str], partial: dict[str, torch.Tensor]):
        self.modules, self.partial = sorted(modules), partial
        super().__init__(f"no {what} name for the LoRA on {few(self.modules)}")


def few(names: list[str], shown: int = 5) -> str:
    """The first `shown` names and how many there are in all."""
    more = f" ... ({len(names)} in all)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


@dataclass(frozen=True)
class LoraFormat:
    """A LoRA file besides the diffusers one: its name, its tensors (`build()`, which raises
    NotInFormat for modules the format cannot hold) and its safetensors metadata."""

    file: str
    build: Callable[[], dict[str, torch.Tensor]]
    metadata: dict[str, str] | None = None


class NotWritten(Exception):
    """A format that has no exact form of the trained adapter: recorded in exports.json with the
    reason, never written approximately."""


def _refuse(reason: str) -> Callable[[], dict[str, torch.Tensor]]:
    def build():
        raise NotWritten(reason)
    return build


def adapter_formats(weights: dict[str, torch.Tensor], metadata: dict[str, Any],
                    formats_of: FormatsOf) -> list[LoraFormat]:
    """The family's formats (`formats_of(weights, metadata)`) for the adapter `weights` hold.
    The families' ComfyUI and kohya maps take LoRA (A, B) pairs: for a DoRA they are refused
    (ComfyUI and kohya divide a `dora_scale` by the norm of the base weight's rows, or of its
    columns; peft's magnitude divides by the norm of the adapted weight's rows, so no file of
    theirs is exact without the base weights). A LoKr or LoHa gets a LyCORIS-named file, and
    each format's file holds its LyCORIS tensors under that format's names (which ComfyUI
    applies natively): the names the family's writer gives each module (`lora_names`), for the
    modules it writes whole; a module it stacks with others into one weight is left out."""
    from dpipe.config.schema import Adapter
    from dpipe.models.adapters import adapter_kind, adapter_shapes, lycoris_tensors

    kind = adapter_kind(weights)
    formats = formats_of(weights, metadata)
    if kind == Adapter.lora:
        return formats
    if kind == Adapter.dora:
        reason = ("DoRA: this format has no exact form of DoRA's magnitude (its loaders normalise "
                  "by the base weight, peft by the adapted weight); the diffusers file holds it")
        return [LoraFormat(f.file, _refuse(reason), f.metadata) for f in formats]
    from dpipe.models.lora_names import format_modules

    names = format_modules(formats_of, adapter_shapes(weights))

    def in_names(file: str) -> Callable[[], dict[str, torch.Tensor]]:
        whole = {parts[0].module: name for name, parts in names.get(file, {}).items()
                 if len(parts) == 1 and parts[0].whole}

        def build():
            held = {k: v for k, v in weights.items() if _module_of(k) in whole}
            tensors = lycoris_tensors(held, metadata, name=lambda m: whole[m])
            left = sorted({_module_of(k) for k in weights} - set(whole))
            if left:
                raise NotInFormat(f"{kind.value} {file}", left, tensors)
            return tensors
        return build

    return ([LoraFormat(LYCORIS_FILE[kind.value], lambda: lycoris_tensors(weights, metadata),
                        {"format": "pt"})]
            + [LoraFormat(f.file, in_names(f.file), f.metadata) for f in formats])


def _module_of(key: str) -> str:
    """The module of a diffusers-named adapter key (`<module>.lokr_w1`)."""
    from dpipe.models.adapters import modules_of

    return next(iter(modules_of({key: None})))


# The LyCORIS-named file of a LoKr or LoHa, beside the diffusers file.
LYCORIS_FILE = {"lokr": "lycoris_lokr.safetensors", "loha": "lycoris_loha.safetensors"}


# A family's LoRA formats: `lora_formats(weights, metadata)` of its spec.
FormatsOf = Callable[[dict[str, torch.Tensor], dict[str, Any]], list[LoraFormat]]


def write_lora_files(out_dir: Path, write_diffusers: Callable[[], Path],
                     weights: dict[str, torch.Tensor], metadata: dict[str, Any],
                     formats_of: FormatsOf) -> list[Path]:
    """The one way every family writes its LoRA files: the diffusers file first, and whatever
    goes wrong there is raised, since nothing loads a LoRA without it; then each other format on
    its own, so a format that cannot hold a module, or fails, costs none of the others. The
    former leaves those modules out, the latter is not written; each warns once, and
    `exports.json` records what every format holds. The other formats are the family's
    (`formats_of`) for the adapter `weights` (diffusers-named) and `metadata` hold
    (`adapter_formats`). Returns the files written, the diffusers file first. Errors of the disk itself (OSError) are raised: no other file would fare better.
    """
    from safetensors.torch import save_file

    diffusers_file = write_diffusers()
    written = [diffusers_file]
    record: dict[str, dict[str, Any]] = {diffusers_file.name: {"written": True, "left_out": []}}
    formats = adapter_formats(weights, metadata, formats_of)
    for fmt in formats:
        path = out_dir / fmt.file
        try:
            tensors, left_out = fmt.build(), []
        except NotInFormat as err:
            tensors, left_out = err.partial, err.modules
        except NotWritten as err:  # an adapter the format has no exact form of: expected
            log.info("%s not written: %s", fmt.file, err)
            record[fmt.file] = {"written": False, "error": str(err)}
            continue
        except OSError:
            raise
        except Exception as err:  # a bug or an unmapped layout in one format: keep the others
            log.warning("%s not written: %s: %s", fmt.file, type(err).__name__, err)
            record[fmt.file] = {"written": False, "error": f"{type(err).__name__}: {err}"}
            continue
        if left_out:
            log.warning("%s leaves out the LoRA on %d module(s) that its format has no weight "
                        "for: %s; %s holds them", fmt.file, len(left_out), few(left_out),
                        diffusers_file.name)
        if not tensors:
            record[fmt.file] = {"written": False, "left_out": left_out,
                                "error": "no trained module has a name in this format"}
            continue
        contiguous = {k: v.contiguous() for k, v in tensors.items()}
        atomic_write(path, lambda tmp: save_file(contiguous, tmp, metadata=fmt.metadata))
        record[fmt.file] = {"written": True, "left_out": left_out}
        written.append(path)
    atomic_write_text(out_dir / EXPORTS_RECORD, json.dumps({"formats": record}, indent=2) + "\n")
    return written


def export_gaps(out_dir: Path) -> str | None:
    """One line naming the format files of `out_dir`'s exports.json that were not written or
    leave modules out, or None when every format holds every trained module."""
    path = out_dir / EXPORTS_RECORD
    if not path.is_file():
        return None
    gaps = []
    for name, held in json.loads(path.read_text())["formats"].items():
        if not held.get("written"):
            gaps.append(f"{name} not written ({held.get('error', 'no reason recorded')})")
        elif held.get("left_out"):
            gaps.append(f"{name} leaves out {len(held['left_out'])} module(s)")
    if not gaps:
        return None
    return f"LoRA export {out_dir}: {'; '.join(gaps)}; see {path} (the diffusers file holds all)"
