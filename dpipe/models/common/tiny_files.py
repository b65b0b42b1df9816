"""Writing tiny models' components in the real repos' layout (shards and index files as released).

Three writers with three shard rules, kept as they are so the tiny folders the tests assert on
stay byte for byte the same: `save_sharded` (the video families) fills files up to one share or
the largest tensor; `save_component` (the Qwen-Image family and its kin) also gives one dominating
tensor a file of its own; `save_exact_shards` (the FLUX families, Chroma) fills files up to one
share plus the largest tensor, which gives exactly the number of files asked for.
"""

from __future__ import annotations

from pathlib import Path

import torch


def save_sharded(model: torch.nn.Module, directory: Path, shards: int,
                 dtype: torch.dtype = torch.bfloat16) -> None:
    """`save_pretrained` in `dtype`, split into about `shards` files (+ index) when > 1, as the
    real checkpoints are, so code reading the weight files meets the same layout."""
    # Greedy filling up to one share (or the largest tensor, if bigger): at least `shards` files,
    # and more when one tensor dominates (as the ByT5 projection does in tiny HunyuanVideo 1.5).
    _save(model, directory, shards, dtype, lambda share, largest, total: max(share, largest))


def save_component(model: torch.nn.Module, directory: Path, shards: int, dtype: torch.dtype) -> None:
    """save_pretrained in `dtype`; with shards > 1, split into about that many files with an index
    file, as the real repos' large components are (a tensor is never split, so one dominating
    tensor can leave fewer files; never just one)."""
    def cap(share: int, largest: int, total: int) -> int:
        # Where that cap would hold everything, one tensor outweighs the rest: it gets a file
        # of its own.
        return largest if max(share, largest) >= total else max(share, largest)

    _save(model, directory, shards, dtype, cap)


def save_exact_shards(model: torch.nn.Module, directory: Path, shards: int,
                      dtype: torch.dtype = torch.bfloat16) -> None:
    """`save_pretrained` in `dtype`, in exactly `shards` files (+ index) when > 1."""
    # Greedy filling with whole tensors: a cap of one share plus the largest tensor makes each
    # file hold at least one share, so exactly `shards` files come out.
    _save(model, directory, shards, dtype, lambda share, largest, total: share + largest)


def _save(model: torch.nn.Module, directory: Path, shards: int, dtype: torch.dtype,
          cap) -> None:
    """`save_pretrained` in `dtype`; with shards > 1, in files of at most `cap(share, largest,
    total)` bytes (share: a `shards`-th of the total, largest: the largest tensor's)."""
    torch.nn.Module.to(model, dtype)  # plain Module.to: diffusers' override warns needlessly
    if shards == 1:
        model.save_pretrained(directory)
        return
    unique = {t.data_ptr(): t for t in model.state_dict().values()}.values()  # tied weights once
    sizes = [t.numel() * t.element_size() for t in unique]
    total = sum(sizes)
    model.save_pretrained(directory, max_shard_size=cap(-(-total // shards), max(sizes), total))


def save_parts(out: Path, save, dtype: torch.dtype, scheduler,
               **parts: tuple[torch.nn.Module, int]) -> None:
    """The scheduler's config, then each part (`name=(model, shards)`) in its folder of `out`, in
    `dtype`, by `save`: one of the writers above, whose shard rule the family's folders keep."""
    scheduler.save_pretrained(out / "scheduler")
    for name, (model, shards) in parts.items():
        save(model, out / name, shards=shards, dtype=dtype)
