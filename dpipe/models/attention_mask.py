"""Text padding in attention: trimmed away where it can be, and otherwise masked in the form each
attention kernel runs fastest.

A mask of any value rules out SDPA's flash kernel: under HunyuanVideo's text-padding mask its
fallback took 2.5x as long on an H200 (docs/performance.md). So a micro-batch's text is first cut
to its longest prompt (`trim_text_padding`); when no padding is left, which is always the case at
one sample per micro-batch, the layers pass no mask at all.

SDPA takes a dense boolean mask. FlexAttention takes a `BlockMask`: which 128x128 tiles of the
score matrix to compute, and which of them need the mask applied. Given a dense mask, diffusers'
flex path builds the BlockMask by evaluating it at every (query, key) pair, in every block of
every step. Here it is built from the keys alone: a padding mask is the same for every query, so
each key tile is skipped (all padding), computed whole (no padding) or masked (some padding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dpipe.config.schema import AttentionKernel

TILE = 128  # FlexAttention's default sparse block size


def trim_text_padding(text: torch.Tensor, mask: torch.Tensor):
    """(B, L, ...) text and its (B, L) mask (1 = a real token) -> both cut after the last position
    that is real in any sample; keys that every query masks out change no output. When no padding
    is left the mask comes back empty, (B, 0): see `has_padding`. Runs where batches are made, on
    the CPU (a GPU mask would make the host wait)."""
    real = mask.bool().any(dim=0)
    length = int(real.nonzero().max()) + 1 if bool(real.any()) else 1
    text, mask = text[:, :length], mask[:, :length]
    return text, mask[:, :0] if bool(mask.bool().all()) else mask


def has_padding(mask: torch.Tensor) -> bool:
    """Whether a trimmed mask still masks anything: read from its shape, so a compiled layer
    specializes on it instead of reading the GPU."""
    return mask.shape[1] > 0


def padding_mask(mask: torch.Tensor) -> torch.Tensor | None:
    """A trimmed mask as a block's boolean attention mask, or None where nothing is padded."""
    return mask.bool() if has_padding(mask) else None


def real_tokens(mask: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, N) bool: which of `tokens` (B, N, ...) are real, from their trimmed mask, which is
    empty when all are."""
    if has_padding(mask):
        return mask.bool()
    return torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)


def joint_padding_mask(*streams: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Text streams, each a trimmed (tokens, mask) pair, joined and ordered real tokens first
    per sample, then cut after the sample with the most: the mask of that joint text, (B, that
    many) int64, or (B, 0) when no stream has padding left, so the joint length is the streams'.
    (Equal totals over padded streams keep an all-true mask: its length says where to cut.)"""
    real = sum(real_tokens(mask, tokens).sum(1) for tokens, mask in streams)
    if bool((real == sum(tokens.shape[1] for tokens, _ in streams)).all()):
        return torch.zeros(real.shape[0], 0, dtype=torch.long)
    return (torch.arange(int(real.max()))[None, :] < real[:, None]).long()


def key_mask(lengths: torch.Tensor, length: int) -> torch.Tensor:
    """(B, length) bool mask of the first `lengths[i]` positions, made on the lengths' device.
    Whether any mask is needed is decided where batches are made, on the CPU
    (`has_padding`): reading the lengths on a GPU would make the host wait."""
    return torch.arange(length, device=lengths.device)[None, :] < lengths[:, None]


def trim_or_drop(text: torch.Tensor, mask: torch.Tensor):
    """`trim_text_padding`, but a stream with no real token in any sample (HunyuanImage's and
    HunyuanVideo 1.5's glyph text without quoted words) keeps no positions at all."""
    if bool(mask.bool().any()):
        return trim_text_padding(text, mask)
    return text[:, :0], mask[:, :0]


def key_padding_mask(key_valid: torch.Tensor, kernel: AttentionKernel):
    """`key_valid` (B, N) bool: which keys every query may attend to. Returns the mask to pass as
    a diffusers block's `attention_mask`: (B, 1, 1, N) bool for sdpa, a BlockMask for flex."""
    if kernel == AttentionKernel.flex:
        return key_padding_block_mask(key_valid)
    return key_valid[:, None, None, :]


def key_padding_block_mask(key_valid: torch.Tensor):
    from torch.nn.attention.flex_attention import BlockMask

    batch, length = key_valid.shape
    tiles = -(-length // TILE)
    # Padded with False to whole tiles: the kernel reads the mask up to the last tile's end.
    padded = F.pad(key_valid, (0, tiles * TILE - length), value=False)
    valid_per_tile = padded.view(batch, 1, tiles, TILE).sum(-1).expand(batch, tiles, tiles)
    whole = valid_per_tile == TILE  # (B, query tile, key tile)
    if length % TILE:  # the last query tile runs past the sequence: no whole tile there, as
        # create_block_mask also finds
        whole = torch.cat([whole[:, :-1], torch.zeros_like(whole[:, -1:])], dim=1)
    part = (valid_per_tile > 0) & ~whole

    def listed(chosen: torch.Tensor):
        """(B, query tile, key tile) bool -> per query tile: how many key tiles, and their indices
        first (the rest in any order), as BlockMask lists them."""
        count = chosen.sum(-1, dtype=torch.int32)
        order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return count[:, None], order[:, None]

    def mask_mod(b, h, q_idx, kv_idx):
        return padded[b, kv_idx]

    return BlockMask.from_kv_blocks(*listed(part), *listed(whole), BLOCK_SIZE=TILE,
                                    mask_mod=mask_mod, seq_lengths=(length, length))
