"""Helpers shared by the Qwen-Image, Z-Image and Lumina 2 families.

These three families are one owner's; what they share lives here rather than in each family
folder: the grad rule for stage outputs, masks from integer lengths, LoRA export in diffusers and
ComfyUI form, and saving tiny components in the real repos' layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


# ---- pipeline stage I/O -------------------------------------------------------------------------
def needs_grad(t: torch.Tensor) -> torch.Tensor:
    """A float tensor leaving a stage must take a gradient on the way back. Under LoRA the
    embedders are frozen, so their outputs carry none; a leaf that requires grad gives DeepSpeed's
    backward a valid end point (see docs on stage I/O)."""
    if torch.is_grad_enabled() and not t.requires_grad:
        return t.detach().requires_grad_()
    return t


def key_mask(lengths: torch.Tensor, length: int) -> torch.Tensor:
    """(B, length) bool mask of the first `lengths[i]` positions, made on the lengths' device.
    Whether any mask is needed is decided where batches are made, on the CPU
    (`dpipe.models.attention_mask`): reading the lengths on a GPU would make the host wait."""
    return torch.arange(length, device=lengths.device)[None, :] < lengths[:, None]


def weighted_labels(batch) -> tuple[torch.Tensor, ...]:
    """(target,) or, when the dataset gives per-pixel loss weights (masks, (B, 1, h, w) at latent
    resolution), (target, weight) for `weighted_mse`; the target is (B, C, h, w)."""
    weight = getattr(batch, "loss_weight", None)
    return (batch.target,) if weight is None else (batch.target, weight)


def weighted_mse(outputs: torch.Tensor, labels: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """MSE, or with a (B, 1, h, w) weight broadcast over channels as flow-matching losses of
    masked datasets are (the mean over all elements, as the unweighted loss)."""
    err = (outputs.float() - labels[0].float()).square()
    if len(labels) == 1:
        return err.mean()
    return (labels[1].float() * err).mean()


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ---- LoRA export --------------------------------------------------------------------------------
def lora_metadata(cfg, default_targets) -> dict[str, Any]:
    rank = cfg.lora.rank
    return {
        "r": rank,
        "lora_alpha": cfg.lora.alpha if cfg.lora.alpha is not None else rank,
        "target_modules": cfg.lora.targets or default_targets,
    }


def peft_to_diffusers(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """peft names carry the adapter name ("lora_A.default.weight"); diffusers' format does not."""
    return {k.replace(".default.", "."): v.contiguous() for k, v in state_dict.items()}


def lora_pairs(weights: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module name: (A, B)} from diffusers-format LoRA weights."""
    out = {}
    for key, a in weights.items():
        if key.endswith(".lora_A.weight"):
            module = key[: -len(".lora_A.weight")]
            out[module] = (a, weights[f"{module}.lora_B.weight"])
    return out


def fuse_lora(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """LoRAs of Linears whose outputs are concatenated (q, k, v -> qkv) as one LoRA of the fused
    Linear: A's stacked, B's block-diagonal, so B @ A is exactly the stacked B_i @ A_i. The rank
    grows to the sum of ranks; callers scale alpha by the same factor to keep alpha / rank."""
    a = torch.cat([p[0] for p in parts], dim=0)
    b = torch.block_diag(*[p[1] for p in parts])
    return a, b


def save_comfy_lora(pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]], path: Path) -> Path:
    """Write {ComfyUI module name: (A, B, alpha)} as a ComfyUI LoRA: keys
    "diffusion_model.<module>.lora_A.weight" / ".lora_B.weight" / ".alpha", which ComfyUI's LoRA
    loader maps onto its own model keys ("diffusion_model.<module>.weight") for any model."""
    tensors = {}
    for module, (a, b, alpha) in sorted(pairs.items()):
        tensors[f"diffusion_model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"diffusion_model.{module}.lora_B.weight"] = b.contiguous()
        tensors[f"diffusion_model.{module}.alpha"] = torch.tensor(float(alpha))
    save_file(tensors, path, metadata={"format": "pt"})
    return path


# ---- tiny models --------------------------------------------------------------------------------
def save_component(model: torch.nn.Module, directory: Path, shards: int, dtype: torch.dtype) -> None:
    """save_pretrained in `dtype`; with shards > 1, split into about that many files with an index
    file, as the real repos' large components are (a tensor is never split, so one dominating
    tensor can leave fewer files; never just one)."""
    # Plain nn.Module.to: diffusers' override warns about fp32-kept modules, which these have none of.
    torch.nn.Module.to(model, dtype)
    if shards == 1:
        model.save_pretrained(directory)
        return
    # One entry per storage: tied weights are written once.
    unique = {t.data_ptr(): t for t in model.state_dict().values()}.values()
    sizes = [t.numel() * t.element_size() for t in unique]
    cap = max(-(-sum(sizes) // shards), max(sizes))
    if cap >= sum(sizes):  # one tensor outweighs the rest: give it a file of its own
        cap = max(sizes)
    model.save_pretrained(directory, max_shard_size=cap)
