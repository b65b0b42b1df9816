"""The table engine for original-layout key maps: fused Linears stacked and split.

Original checkpoints (BFL's FLUX layout, Tencent's HunyuanImage and HunyuanVideo 1.5 layouts) fuse
what diffusers keeps apart: q, k, v in one `qkv` Linear, the single blocks' q, k, v and MLP input
in `linear1`. Each of those families lists its layout once, as `FusedLinear` rows (original
module, the diffusers modules stacked in it along the output dimension, their output sizes), and
this module turns that one table into both directions: `to_original` (tiny single files, a full
fine-tune written back in its source's layout) and `from_original` (loading, split at the
model's own sizes, so no checkpoint width is hard-coded).
"""

from __future__ import annotations

import torch

# Output sizes are needed only to split a module that stacks several parts (None elsewhere).
FusedLinear = tuple[str, list[str], list]


def swap_halves(t: torch.Tensor) -> torch.Tensor:
    """The two output halves exchanged (the originals' final modulation is (shift, scale), the
    diffusers layers' (scale, shift))."""
    first, second = t.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def stack_fused(state: dict[str, torch.Tensor], fused: list[FusedLinear], swapped: set[str]
                ) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Diffusers weights -> the original fused modules (parts concatenated in order; halves
    swapped for the modules in `swapped`); also returns the diffusers keys used."""
    out, used = {}, set()
    for original, parts, _ in fused:
        for param in ("weight", "bias"):
            keys = [f"{p}.{param}" for p in parts]
            if not all(k in state for k in keys):
                continue
            value = torch.cat([state[k] for k in keys], dim=0)
            out[f"{original}.{param}"] = swap_halves(value) if original in swapped else value
            used.update(keys)
    return out, used


def split_fused(state: dict[str, torch.Tensor], fused: list[FusedLinear], swapped: set[str]
                ) -> dict[str, torch.Tensor]:
    """The original fused modules of `state` -> their diffusers parts, split at the given sizes.
    Names `fused` does not know pass through unchanged."""
    out = dict(state)
    for original, parts, sizes in fused:
        for param in ("weight", "bias"):
            value = out.pop(f"{original}.{param}", None)
            if value is None:
                continue
            if original in swapped:
                value = swap_halves(value)
            if len(parts) == 1:
                out[f"{parts[0]}.{param}"] = value
                continue
            if value.shape[0] != sum(sizes):
                raise ValueError(f"{original}.{param} has {value.shape[0]} rows; this model's "
                                 f"config gives {sum(sizes)} ({' + '.join(map(str, sizes))})")
            for part, piece in zip(parts, value.split(sizes, dim=0)):
                out[f"{part}.{param}"] = piece
    return out


# BFL's and Tencent's final modulation emits (shift, scale); diffusers' AdaLayerNormContinuous
# (scale, shift). The layouts name that Linear alike.
FINAL_MODULATION = frozenset({"final_layer.adaLN_modulation.1"})


def to_original(state: dict[str, torch.Tensor], fused: list[FusedLinear], what: str,
                renames: dict[str, str] | None = None, swapped=FINAL_MODULATION
                ) -> dict[str, torch.Tensor]:
    """A diffusers state dict under the original names: the fused modules stacked, then the
    one-to-one `renames` {original parameter: diffusers parameter} (norm scales). A weight without
    an original name raises ValueError naming the layout (`what`), so nothing is dropped silently."""
    out, used = stack_fused(state, fused, swapped)
    for original, diffusers in (renames or {}).items():
        out[original] = state[diffusers]
        used.add(diffusers)
    left = sorted(set(state) - used)
    if left:
        raise ValueError(f"no {what} name for {', '.join(left[:5])}")
    return out


def from_original(state: dict[str, torch.Tensor], fused: list[FusedLinear],
                  renames: dict[str, str] | None = None, swapped=FINAL_MODULATION
                  ) -> dict[str, torch.Tensor]:
    """Original-named weights -> diffusers names, fused modules split at the table's sizes. Names
    the table does not know pass through unchanged (a file already in diffusers names loads as it
    is; anything else is reported by the loader as unexpected)."""
    out = split_fused(state, fused, swapped)
    for original, diffusers in (renames or {}).items():
        if original in out:
            out[diffusers] = out.pop(original)
    return out
