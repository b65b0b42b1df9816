"""A LoRA file of any format users share, read onto the family's diffusers module names.

The format is told from the keys: diffusers (`transformer.<module>.lora_A.weight`, peft's config
in the metadata, as every dpipe export writes it), peft (`base_model.model.<module>...` or bare
`<module>.lora_A.default.weight`), ComfyUI (`diffusion_model.<module>.lora_A.weight` with
`.alpha` tensors), ai-toolkit/musubi-tuner (`diffusion_model.` or `transformer.` names, no
alpha), kohya (`lora_unet_<module with _>.lora_down.weight`, `.alpha`; `lora_te*` for the text
encoders) and LyCORIS (`lycoris_...` or kohya's names): LoKr/LoHa (`.lokr_w1`, `.hada_w1_a`, ...),
LoCon (LoRA keys on convolutions too, a Tucker core `.lora_mid.weight` for a kernel's spatial part),
Tucker LoHa/LoKr (`.hada_t1`/`.hada_t2`, `.lokr_t2`) and DoRA (`.dora_scale`, read as peft's
magnitude where it scales the output rows: LyCORIS's default `wd_on_out`; LyCORIS, peft and this
reader share the definition W' = m * (W + dW) / ||W + dW|| per row).
Module names are placed through the family's `LoraNames` (the writers' own table). A module's
scale follows the loaders' rule: alpha / rank where the file has an alpha (a `.alpha` tensor, or
peft's config), else 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dpipe.config.schema import Adapter
from dpipe.models.adapters import LOHA_PARTS, LOKR_PARTS
from dpipe.models.lora_names import LoraNames, Part, split_key

# Key prefixes and the format whose names follow them (after the prefix: a module name).
PREFIXES = (("base_model.model.", "peft"), ("transformer.", "diffusers"), ("unet.", "diffusers"),
            ("model.diffusion_model.", "ComfyUI"), ("diffusion_model.", "ComfyUI"),
            ("lora_unet_", "kohya"), ("lora_transformer_", "kohya"), ("lycoris_", "LyCORIS"))
# Text encoders' LoRAs (kohya's and diffusers' names): dpipe trains the denoiser only.
TEXT_ENCODER = ("lora_te", "text_encoder", "te_", "te1_", "te2_", "text_model.")
FORMATS_READ = ("diffusers", "peft", "ComfyUI", "ai-toolkit/musubi-tuner", "kohya",
                "LyCORIS LoCon/LoKr/LoHa/DoRA")
# The parts each kind of adapter file may hold (peft's names); any other is named, not guessed.
KNOWN_PARTS = {Adapter.lora: {"lora_A.weight", "lora_B.weight", "lora_mid.weight", "alpha"},
               Adapter.dora: {"lora_A.weight", "lora_B.weight", "alpha", "lora_magnitude_vector",
                              "dora_scale"},
               Adapter.lokr: {*LOKR_PARTS, "lokr_t2", "alpha"},
               Adapter.loha: {*LOHA_PARTS, "hada_t1", "hada_t2", "alpha"}}
# The factor each kind's delta is linear in, which takes a module's scale when it is folded.
# The first of a kind's parts that a module has is the one (dpipe's LyCORIS writer folds a full
# LoKr's scale into lokr_w2 too).
SCALED_PART = {Adapter.lora: ("lora_B.weight",), Adapter.dora: ("lora_B.weight",),
               Adapter.lokr: ("lokr_w2", "lokr_w2_b"), Adapter.loha: ("hada_w1_b",)}


class LoraLayoutError(ValueError):
    """A file whose keys are no LoRA layout dpipe reads, or name modules the family lacks."""


def strip_prefix(key: str) -> tuple[str, str | None]:
    """(the key without its format prefix, that format) or (key, None)."""
    for prefix, fmt in PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix):], fmt
    return key, None


@dataclass
class LoraRead:
    """A file's adapter on the family's diffusers modules: {module: {peft part: tensor}}, each
    module's scale (the factor its product is applied at), and what was left out."""

    format: str
    kind: Adapter
    modules: dict[str, dict[str, torch.Tensor]]
    scales: dict[str, float]
    config: dict = field(default_factory=dict)
    text_encoder: list[str] = field(default_factory=list)

    def tensors(self, scale: float = 1.0) -> dict[str, torch.Tensor]:
        """Diffusers-named tensors (`<module>.lora_A.weight`, ...) for an adapter applied at
        `scale`: each module's own scale / `scale` folded into its scaled factor."""
        out = {}
        for module, parts in self.modules.items():
            factor = self.scales[module] / scale
            scaled = next(p for p in SCALED_PART[self.kind] if p in parts)
            for part, value in parts.items():
                if factor != 1.0 and part == scaled:
                    value = value * factor
                out[f"{module}.{part}"] = value
        return out

    def delta(self, module: str, shape) -> torch.Tensor:
        """The weight delta the file adds to `module` (fp32), as peft and ComfyUI compute it."""
        from dpipe.models.adapters import module_delta

        return module_delta(self.kind, self.modules[module], self.scales[module], shape)

    def ranks(self) -> dict[str, int]:
        from dpipe.models.adapters import module_rank

        return {m: module_rank(self.kind, parts) for m, parts in self.modules.items()}


def read_keys(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    return load_file(str(path)), meta


def detect_format(keys) -> tuple[str, Adapter]:
    """(format, adapter kind) of a LoRA file's keys; LoraLayoutError naming the keys that are
    no LoRA part, and the formats dpipe reads."""
    from dpipe.models.adapters import adapter_kind

    keys = list(keys)
    unknown = [k for k in keys if split_key(k) is None]
    if unknown or not keys:
        raise LoraLayoutError(
            f"keys of no LoRA layout dpipe reads: {', '.join(unknown[:5]) or 'no keys'}"
            f"{' ...' if len(unknown) > 5 else ''} ({len(unknown)} of {len(keys)}); dpipe reads "
            f"{', '.join(FORMATS_READ)} files")
    kind = adapter_kind(keys)
    prefixes = {strip_prefix(k)[1] for k in keys if not k.startswith(TEXT_ENCODER)}
    lycoris = kind in (Adapter.lokr, Adapter.loha) or any(
        k.endswith((".lora_mid.weight", ".dora_scale")) for k in keys)
    if lycoris and prefixes & {"LyCORIS", "kohya", "ComfyUI"}:
        return "LyCORIS", kind
    if "peft" in prefixes or any(".default" in k for k in keys) or prefixes == {None}:
        return "peft", kind
    if "kohya" in prefixes:
        return "kohya", kind
    if "ComfyUI" in prefixes:
        comfy = any(k.endswith(".alpha") for k in keys)
        return ("ComfyUI" if comfy else "ComfyUI-named, no alpha (ai-toolkit, musubi-tuner)"), kind
    return "diffusers", kind


def read_lora(path: Path, names: LoraNames, family: str = "this family") -> LoraRead:
    """The LoRA file at `path` on the diffusers modules of `names`. LoraLayoutError for keys of
    no known layout, and for modules that fit none of the family's (the first few named)."""
    tensors, meta = read_keys(path)
    fmt, kind = detect_format(tensors)
    config, default_scale = file_config(path, meta, fmt)
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    text_encoder = []
    for key, value in tensors.items():
        module, part = split_key(key)
        if module.startswith(TEXT_ENCODER):
            text_encoder.append(module)
            continue
        grouped.setdefault(module, {})[part] = value
    modules: dict[str, dict[str, torch.Tensor]] = {}
    scales: dict[str, float] = {}
    unplaced, unfit, unread, columns = [], [], [], []
    for raw, parts in sorted(grouped.items()):
        name, prefix = strip_prefix(raw)
        found = names.place(name, format_first=prefix in ("ComfyUI", "kohya", "LyCORIS"))
        if found is None and prefix is not None:  # a denoiser of several components (Anima)
            found = names.place(raw, format_first=False)
        if found is None:
            unplaced.append(raw)
            continue
        odd = sorted(set(parts) - KNOWN_PARTS[kind])
        if odd:
            unread += [f"{raw}.{p}" for p in odd]
            continue
        scale = _scale(parts, kind, default_scale(name))
        parts = {p: v for p, v in parts.items() if p != "alpha"}
        if "dora_scale" in parts:
            magnitude = _row_magnitude(parts.pop("dora_scale"), names.shapes[found[0].module])
            if magnitude is None:
                columns.append(raw)
                continue
            parts["lora_magnitude_vector"] = magnitude
        for module, share in _shares(parts, found, kind, names.shapes):
            placed = scale
            if share is not None and module in modules:
                share = _stacked(modules[module], scales[module], share, scale, kind)
                placed = 1.0  # both scales are folded into the stacked B
            if share is None:
                unfit.append(raw)
                break
            modules[module], scales[module] = share, placed
    if unread:
        raise LoraLayoutError(
            f"{len(unread)} key(s) of a {kind.value} file that dpipe cannot place: "
            f"{', '.join(unread[:5])}{' ...' if len(unread) > 5 else ''} (parts of no adapter "
            f"dpipe reads, e.g. LyCORIS's full `diff`, or a dora_scale on a LoKr/LoHa; dpipe "
            f"reads {', '.join(FORMATS_READ)} files)")
    if columns:
        raise LoraLayoutError(
            f"{len(columns)} module(s) carry a dora_scale over the weight's input columns "
            f"(LyCORIS's wd_on_out=False): {', '.join(columns[:5])}; peft's DoRA, which dpipe "
            "trains and merges, scales output rows: retrain with wd_on_out, or merge it with "
            "LyCORIS first")
    if unplaced:
        raise LoraLayoutError(
            f"{len(unplaced)} of its {len(grouped)} modules fit no module of {family}: "
            f"{', '.join(unplaced[:5])}{' ...' if len(unplaced) > 5 else ''} (read as a {fmt} "
            f"file; dpipe reads {', '.join(FORMATS_READ)} files)")
    if unfit:
        raise LoraLayoutError(
            f"{len(unfit)} module(s) have no exact form on {family}'s diffusers modules: "
            f"{', '.join(unfit[:5])} (a {kind.value} on a weight that stacks several, or twice "
            "the same module)")
    return LoraRead(fmt, kind, modules, scales, config, sorted(set(text_encoder)))


def file_config(path: Path, meta: dict[str, str], fmt: str):
    """(peft's config from the file's metadata or a peft folder's adapter_config.json, a
    function giving a module's scale where no `.alpha` tensor says it)."""
    config = {}
    if "lora_adapter_metadata" in meta:
        config = json.loads(meta["lora_adapter_metadata"])
        prefix = next((p for p, _ in PREFIXES if any(k.startswith(p) for k in config)), "")
        config = {k.removeprefix(prefix): v for k, v in config.items()}
    elif (path.parent / "adapter_config.json").is_file() and fmt == "peft":
        config = json.loads((path.parent / "adapter_config.json").read_text())
    if "r" not in config:
        return config, lambda name: None
    alpha = config.get("lora_alpha", config.get("alpha", config["r"]))
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    return config, lambda name: alphas.get(name, alpha) / ranks.get(name, config["r"])


def _scale(parts: dict[str, torch.Tensor], kind: Adapter, configured: float | None) -> float:
    """A module's scale: its `.alpha` over its rank (the loaders' rule), else peft's config,
    else 1."""
    from dpipe.models.adapters import module_rank

    alpha = parts.get("alpha")
    if alpha is not None:
        rank = module_rank(kind, parts)
        return float(alpha) / rank if rank is not None else 1.0
    return configured if configured is not None else 1.0


def _row_magnitude(dora_scale: torch.Tensor, shape) -> torch.Tensor | None:
    """peft's DoRA magnitude (out,) from a LyCORIS `dora_scale` over the output rows ((out, 1,
    ...)), None for one over the input columns ((1, in, ...))."""
    if dora_scale.shape[0] != shape[0] or dora_scale.numel() != shape[0]:
        return None
    return dora_scale.reshape(-1)


def _shares(parts: dict[str, torch.Tensor], found: list[Part], kind: Adapter, shapes):
    """(diffusers module, its parts or None where it has no exact form) for each of a file
    module's parts."""
    if len(found) == 1 and _whole(found[0], shapes):
        yield found[0].module, parts
        return
    if kind not in (Adapter.lora, Adapter.dora) or "lora_magnitude_vector" in parts \
            or "lora_mid.weight" in parts:
        if len(found) == 1 and _whole(found[0], shapes):
            yield found[0].module, parts
        else:
            yield found[0].module, None
        return
    a, b = parts["lora_A.weight"], parts["lora_B.weight"]
    rank = a.shape[0]
    for part in found:
        rows = b[part.file_rows]
        size = rank // part.parts
        if part.parts > 1 and rank % part.parts == 0 and _block_diagonal(b, found, size):
            cols = slice(part.index * size, (part.index + 1) * size)
            a_part, rows = a[cols], rows[:, cols]
        else:
            a_part = a
        b_part = b.new_zeros((shapes[part.module][0], rows.shape[1]))
        b_part[part.rows] = rows
        yield part.module, {"lora_A.weight": a_part.contiguous(), "lora_B.weight": b_part}


def _whole(part: Part, shapes) -> bool:
    """The file module is the part's module, row for row: every row of it (a module the file
    fuses with others, Chroma's `img_attn.qkv` for to_q, has more)."""
    return part.whole and len(part.rows) == shapes[part.module][0]


def _stacked(first: dict[str, torch.Tensor], first_scale: float, second: dict[str, torch.Tensor],
             second_scale: float, kind: Adapter) -> dict[str, torch.Tensor] | None:
    """One LoRA on a module from two that change disjoint rows of it (the file's module fuses
    several diffusers modules: Chroma's `img_attn.qkv` takes a LoRA's to_q, to_k and to_v): A's
    rows stacked, B's columns side by side with each one's scale folded in (fp32), so that B @ A
    is the sum. None where they are no plain LoRAs or share a row (the same module twice)."""
    plain = {"lora_A.weight", "lora_B.weight"}
    if kind != Adapter.lora or set(first) != plain or set(second) != plain:
        return None
    b1, b2 = first["lora_B.weight"], second["lora_B.weight"]
    if b1.shape[0] != b2.shape[0] or (b1.flatten(1).any(1) & b2.flatten(1).any(1)).any():
        return None
    return {"lora_A.weight": torch.cat([first["lora_A.weight"].float(),
                                        second["lora_A.weight"].float()]),
            "lora_B.weight": torch.cat([first_scale * b1.float(), second_scale * b2.float()],
                                       dim=1)}


def _block_diagonal(b: torch.Tensor, found: list[Part], size: int) -> bool:
    """Whether each part's rows of B use only its own block of `size` columns: a fused LoRA as
    dpipe writes it (each part's own A stacked), rather than one shared A."""
    for part in found:
        rows = b[part.file_rows]
        outside = torch.ones(b.shape[1], dtype=torch.bool)
        outside[part.index * size:(part.index + 1) * size] = False
        if rows[:, outside].any():
            return False
    return True
