"""Key-padding masks for sdpa and FlexAttention (dpipe.models.attention_mask)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from dpipe.config.schema import AttentionKernel
from dpipe.models.attention_mask import (
    has_padding, key_padding_block_mask, key_padding_mask, trim_text_padding)


def _patterns():
    """Padding at the end (a prefix of valid keys), a gap over a whole tile and more, no padding,
    and lengths that are not whole tiles."""
    prefix = torch.ones(2, 300, dtype=torch.bool)
    prefix[0, 250:] = False
    prefix[1, 40:170] = False
    whole = torch.ones(1, 256, dtype=torch.bool)
    short = torch.arange(70)[None, :] < torch.tensor([[5], [69]])
    return [prefix, whole, short]


@pytest.mark.parametrize("key_valid", _patterns())
def test_block_mask_has_the_tiles_of_the_dense_mask(key_valid):
    """Which tiles are computed and which of them are whole, as FlexAttention's own
    create_block_mask finds them by evaluating the mask everywhere."""
    batch, length = key_valid.shape
    ours = key_padding_block_mask(key_valid)
    reference = create_block_mask(lambda b, h, q, kv: key_valid[b, kv], batch, None, length,
                                  length, device="cpu")
    assert torch.equal(ours.to_dense(), reference.to_dense())
    whole = lambda m: BlockMask.from_kv_blocks(m.full_kv_num_blocks, m.full_kv_indices,
                                               BLOCK_SIZE=m.BLOCK_SIZE, seq_lengths=m.seq_lengths)
    assert torch.equal(whole(ours).to_dense(), whole(reference).to_dense())
    assert ours.seq_lengths == (length, length)


@pytest.mark.slow
def test_compiled_flex_under_the_block_mask_gives_masked_sdpa_output():
    """Compiled, FlexAttention reads the tile lists (the eager path evaluates the mask alone)."""
    torch.manual_seed(0)
    key_valid = _patterns()[0]
    q, k, v = (torch.randn(2, 2, 300, 16) for _ in range(3))
    sdpa = F.scaled_dot_product_attention(
        q, k, v, attn_mask=key_padding_mask(key_valid, AttentionKernel.sdpa))
    flex = torch.compile(flex_attention)(
        q, k, v, block_mask=key_padding_mask(key_valid, AttentionKernel.flex))
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


def test_sdpa_gets_the_dense_mask():
    key_valid = _patterns()[2]
    assert torch.equal(key_padding_mask(key_valid, AttentionKernel.sdpa), key_valid[:, None, None])


def test_text_is_cut_after_the_longest_prompt():
    text = torch.arange(2 * 6).view(2, 6, 1).float()
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    cut, cut_mask = trim_text_padding(text, mask)
    assert torch.equal(cut, text[:, :3]) and torch.equal(cut_mask, mask[:, :3])
    assert has_padding(cut_mask)


def test_text_with_no_padding_left_gets_an_empty_mask():
    text = torch.randn(1, 6, 4)
    cut, cut_mask = trim_text_padding(text, torch.tensor([[1, 1, 1, 1, 0, 0]]))
    assert torch.equal(cut, text[:, :4]) and cut_mask.shape == (1, 0)
    assert not has_padding(cut_mask)


def test_only_positions_padded_in_every_sample_are_cut():
    """Never a real token: padding on the left, or between real tokens, stays (and is masked)."""
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 0, 1]])
    cut, cut_mask = trim_text_padding(torch.randn(2, 4, 3), mask)
    assert cut.shape == (2, 4, 3) and torch.equal(cut_mask, mask)
    empty, empty_mask = trim_text_padding(torch.randn(1, 4, 3), torch.zeros(1, 4, dtype=torch.long))
    assert empty.shape == (1, 1, 3) and torch.equal(empty_mask, torch.zeros(1, 1, dtype=torch.long))


def test_joint_padding_mask_is_empty_only_where_the_streams_say_the_length():
    from dpipe.models.attention_mask import joint_padding_mask, trim_or_drop

    def stream(*lengths, width=6):
        mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        return trim_or_drop(torch.randn(len(lengths), width, 4), mask)

    # One sample, or samples that fill both trimmed streams: nothing to mask.
    assert joint_padding_mask(stream(2), stream(5)).shape == (1, 0)
    assert joint_padding_mask(stream(2, 2), stream(5, 5)).shape == (2, 0)
    # A stream with no real token anywhere is dropped, and adds nothing.
    glyph = stream(0, 0)
    assert glyph[0].shape[1] == 0 and joint_padding_mask(glyph, stream(4, 4)).shape == (2, 0)
    # Different totals: each sample's real tokens first, cut after the most.
    assert joint_padding_mask(stream(1, 0), stream(5, 3)).tolist() == [
        [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    # Equal totals over padded streams (3 + 2 and 0 + 5): an all-true mask of the joint length 5,
    # shorter than the streams' 3 + 5 together.
    assert joint_padding_mask(stream(3, 0), stream(2, 5)).tolist() == [[1] * 5, [1] * 5]
