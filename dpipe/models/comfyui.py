"""LoRA weights in the key layout ComfyUI loads, for every family that exports one.

ComfyUI's LoRA loader accepts `diffusion_model.<module>.lora_A.weight` / `.lora_B.weight` (and an
optional `.alpha`; without it the scale is 1) where `<module>` is a weight of the original
(non-diffusers) checkpoint. Those checkpoints often fuse what diffusers keeps apart (HunyuanVideo:
one `img_attn_qkv` for `to_q`, `to_k`, `to_v`). A LoRA on the parts becomes an exact LoRA on the
fused weight: the A matrices stacked (rank n*r), the B matrices block-diagonal. The LoRA scale
alpha/r is folded into B, so no alpha is written and every loader applies scale 1; or, for families
whose files have always kept it (`save_comfy_lora`), written as `.alpha`.
`apply_comfy_lora` merges such a file as ComfyUI does, for tests and for merging by hand.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from dpipe.models.common.key_tables import swap_halves
from dpipe.models.lora_files import NotInFormat

COMFY_PREFIX = "diffusion_model."


def peft_pairs(state_dict: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{diffusers module name: (A, B)} from peft/diffusers LoRA weights (adapter names removed)."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        key = key.replace(".default.", ".")
        for part in ("lora_A", "lora_B"):
            marker = f".{part}.weight"
            if key.endswith(marker):
                pairs.setdefault(key[: -len(marker)], {})[part] = value
    return {name: (ab["lora_A"], ab["lora_B"]) for name, ab in pairs.items()}


def fused_pair(parts: list[tuple[torch.Tensor, torch.Tensor] | None], out_dims: list[int | None],
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One (A, B) for a weight that stacks `parts` along its output dimension. A part without a
    LoRA (None) contributes zero rows of its `out_dims` size; a size None is the part's own
    (its B's rows), which only a part with a LoRA has."""
    present = [p for p in parts if p is not None]
    out_dims = [p[1].shape[0] if p is not None and rows is None else rows
                for p, rows in zip(parts, out_dims)]
    if None in out_dims:
        raise ValueError("the output size of a fused part without a LoRA is needed")
    a = torch.cat([p[0] for p in present], dim=0)
    b = torch.zeros(sum(out_dims), a.shape[0], dtype=present[0][1].dtype)
    row = col = 0
    for part, rows in zip(parts, out_dims):
        if part is not None:
            r = part[0].shape[0]
            b[row:row + rows, col:col + r] = part[1] * scale
            col += r
        row += rows
    return a.contiguous(), b.contiguous()


def fused_qkv_state(state_dict: dict[str, torch.Tensor], attention: str,
                    rename: Callable[[str], str]) -> dict[str, torch.Tensor]:
    """A diffusers state dict in the original names of models whose checkpoints fuse each
    `<block><attention>.to_q/to_k/to_v` into one `<block>.attention.qkv` (Lumina 2, Z-Image):
    the three concatenated in that order, every other key through `rename`."""
    out = {}
    for key, value in state_dict.items():
        if f"{attention}.to_k." in key or f"{attention}.to_v." in key:
            continue
        if f"{attention}.to_q." in key:
            base, _, tail = key.partition(f"{attention}.to_q.")
            out[f"{base}.attention.qkv.{tail}"] = torch.cat(
                [state_dict[f"{base}{attention}.to_{n}.{tail}"] for n in "qkv"], dim=0)
            continue
        out[rename(key)] = value
    return out


def fused_qkv_lora_pairs(weights: dict[str, torch.Tensor], alpha: float, attention: str,
                         rename: Callable[[str], str], title: str):
    """diffusers-named LoRA weights -> {ComfyUI module: (A, B, alpha)} for the models of
    `fused_qkv_state`: each block's q/k/v LoRAs as one on `<block>.attention.qkv` (alpha / rank
    unchanged), every other module through `rename`."""
    pairs = peft_pairs(weights)
    out = {}
    for module, (a, b) in pairs.items():
        if module.endswith((f"{attention}.to_k", f"{attention}.to_v")):
            continue
        if module.endswith(f"{attention}.to_q"):
            base = module[: -len(f"{attention}.to_q")]
            parts = [pairs.get(f"{base}{attention}.{n}") for n in ("to_q", "to_k", "to_v")]
            if any(p is None for p in parts):
                raise ValueError(f"{base}{attention}: a ComfyUI LoRA needs all of to_q, to_k and "
                                 f"to_v (ComfyUI's {title} has one fused qkv Linear)")
            fa, fb = fused_pair(parts, [p[1].shape[0] for p in parts], 1.0)
            out[f"{base}.attention.qkv"] = (fa, fb, alpha * 3)
        else:
            out[rename(module)] = (a, b, alpha)
    return out


def to_comfyui(state_dict: dict[str, torch.Tensor], scale: float,
               mapping: Iterable[tuple[str, list[str], list[int | None]]],
               swapped: Collection[str] = (), what: str = "ComfyUI") -> dict[str, torch.Tensor]:
    """ComfyUI LoRA weights from diffusers-named ones. `mapping` lists (original module name,
    the diffusers modules it stacks, their output sizes, None for a part's own); diffusers
    modules with a LoRA that no entry covers raise NotInFormat (with the weights of the others),
    so a trained weight is never dropped silently. The original modules in `swapped` hold the
    diffusers module's two output halves exchanged (a final modulation's (shift, scale) against
    diffusers' (scale, shift)): swap(W + B A) = swap(W) + swap(B) A, so their B's halves are
    exchanged. `what` names the format in that error."""
    pairs = peft_pairs(state_dict)
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for original, parts, out_dims in mapping:
        found = [pairs.get(p) for p in parts]
        if all(f is None for f in found):
            continue
        used.update(p for p in parts if p in pairs)
        a, b = fused_pair(found, out_dims, scale)
        out[f"{COMFY_PREFIX}{original}.lora_A.weight"] = a
        out[f"{COMFY_PREFIX}{original}.lora_B.weight"] = (
            swap_halves(b).contiguous() if original in swapped else b)
    left = sorted(set(pairs) - used)
    if left:
        raise NotInFormat(what, left, out)
    return out


def renamed(state_dict: dict[str, torch.Tensor], scale: float,
            rename=lambda name: name) -> dict[str, torch.Tensor]:
    """ComfyUI LoRA weights for models whose original module names are the diffusers ones (up to
    `rename`): one entry per module, scale folded into B."""
    out = {}
    for name, (a, b) in peft_pairs(state_dict).items():
        out[f"{COMFY_PREFIX}{rename(name)}.lora_A.weight"] = a.contiguous()
        out[f"{COMFY_PREFIX}{rename(name)}.lora_B.weight"] = (b * scale).contiguous()
    return out


def original_linear_name(name: str, top: dict[str, str], block: re.Pattern,
                         renames: dict[str, str], model: str) -> str:
    """The original checkpoint's name of a diffusers Linear: `top`'s for one outside the blocks,
    `blocks.<i>.<renames[part]>` for a block's (`block` matches its index and part); KeyError
    for anything outside the mapping, so a trained weight is never dropped or misnamed
    silently."""
    if name in top:
        return top[name]
    match = block.fullmatch(name)
    if match is None or match.group(2) not in renames:
        raise KeyError(f"no ComfyUI name for {model} module {name!r}")
    return f"blocks.{match.group(1)}.{renames[match.group(2)]}"


def in_original_names(weights: dict[str, torch.Tensor], scale: float, original_name,
                      format_name: str) -> dict[str, torch.Tensor]:
    """ComfyUI LoRA weights from diffusers-named ones (`<module>.lora_A.weight`, ...), each module
    under `original_name(module)`: the original checkpoint's name, which ComfyUI's model keeps.
    The scale alpha / rank is folded into B and no `.alpha` is written, so every loader applies 1.
    Modules `original_name` has no name for (KeyError) raise NotInFormat naming `format_name`,
    with the tensors of the others."""
    out, unnamed = {}, set()
    for key, value in weights.items():
        module, part = key.rsplit(".lora_", 1)
        if not part.startswith(("A.", "B.")):
            raise KeyError(f"not a LoRA weight: {key!r}")
        try:
            name = original_name(module)
        except KeyError:
            unnamed.add(module)
            continue
        value = value * scale if part.startswith("B.") else value
        out[f"{COMFY_PREFIX}{name}.lora_{part}"] = value.contiguous()
    if unnamed:
        raise NotInFormat(format_name, sorted(unnamed), out)
    return out


def comfy_lora_tensors(pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
                       ) -> dict[str, torch.Tensor]:
    """{ComfyUI module name: (A, B, alpha)} as a ComfyUI LoRA's tensors: keys
    "diffusion_model.<module>.lora_A.weight" / ".lora_B.weight" / ".alpha", which ComfyUI's LoRA
    loader maps onto its own model keys ("diffusion_model.<module>.weight") for any model."""
    tensors = {}
    for module, (a, b, alpha) in sorted(pairs.items()):
        tensors[f"{COMFY_PREFIX}{module}.lora_A.weight"] = a.contiguous()
        tensors[f"{COMFY_PREFIX}{module}.lora_B.weight"] = b.contiguous()
        tensors[f"{COMFY_PREFIX}{module}.alpha"] = torch.tensor(float(alpha))
    return tensors


def diffusers_named(weights: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """A ComfyUI LoRA for models whose LoRAs ComfyUI maps by diffusers' module names (Qwen-Image,
    Krea 2, ERNIE-Image: `comfy/lora.py`'s per-model key maps): `diffusion_model.<diffusers
    module>`, with the trained alpha as `.alpha` (ComfyUI reads alpha only from these)."""
    return comfy_lora_tensors({m: (a, b, alpha) for m, (a, b) in peft_pairs(weights).items()})


def with_alpha(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI LoRA tensors whose scale is folded into B, with an `.alpha` per module equal to
    its rank (A's rows): every loader then applies alpha / rank = 1, as the folding intends,
    and none falls back to a rule of its own for a file without alphas."""
    out = dict(tensors)
    for key, value in tensors.items():
        if key.endswith(".lora_A.weight"):
            out[key.removesuffix(".lora_A.weight") + ".alpha"] = torch.tensor(float(value.shape[0]))
    return out


def save_comfy_lora(pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]], path: Path) -> Path:
    """Writes `comfy_lora_tensors(pairs)` to `path`."""
    save_file(comfy_lora_tensors(pairs), path, metadata={"format": "pt"})
    return path


def apply_comfy_lora(native: dict[str, torch.Tensor], lora: dict[str, torch.Tensor],
                     strength: float = 1.0) -> dict[str, torch.Tensor]:
    """Merge a ComfyUI LoRA into a state dict with ComfyUI's own key names, as ComfyUI does
    (W += strength * alpha / rank * B @ A, the product shaped as W: a convolution's too). For
    tests and for users merging by hand."""
    out = dict(native)
    for key, a in lora.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[: -len(".lora_A.weight")]
        b = lora[f"{module}.lora_B.weight"]
        alpha = lora.get(f"{module}.alpha")
        scale = (alpha.item() / a.shape[0]) if alpha is not None else 1.0
        name = module.removeprefix("diffusion_model.") + ".weight"
        if name not in out:
            raise KeyError(f"the LoRA targets {name}, which the model does not have")
        w = out[name]
        delta = (b.float().flatten(1) @ a.float().flatten(1)).reshape(w.shape)
        out[name] = (w.float() + strength * scale * delta).to(w.dtype)
    return out
