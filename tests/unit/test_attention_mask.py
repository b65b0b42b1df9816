"""Key-padding masks for sdpa and FlexAttention (dpipe.models.attention_mask)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from dpipe.config.schema import AttentionKernel
from dpipe.models.attention_mask import key_padding_block_mask, key_padding_mask


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
