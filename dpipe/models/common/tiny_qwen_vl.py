"""A tiny random Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`), the text encoder of Qwen-Image
and the MLLM of OmniGen2, with the real model's structure at a small size: a 2-layer language model
(hidden `text_dim`, grouped-query attention, multimodal RoPE) and a 2-block vision tower with the
real 14-pixel patches, window attention and 2x2 merging."""

from __future__ import annotations

from dpipe.models.common.shapes import round_up


def tiny_qwen25_vl(added: dict[str, int], text_dim: int):
    """The model for a tokenizer whose added tokens are `added` ({token: id},
    `save_qwen_tokenizer`'s answer); seed torch before calling for fixed weights."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab = max(added.values()) + 1
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=round_up(vocab, 128), hidden_size=text_dim, intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                             "mrope_section": [2, 3, 3]},  # sums to head_dim / 2 = 8
            bos_token_id=added["<|endoftext|>"], eos_token_id=added["<|im_end|>"],
            pad_token_id=added["<|endoftext|>"]),
        vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=text_dim,
            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
            fullatt_block_indexes=[1]),
        image_token_id=added["<|image_pad|>"], video_token_id=added["<|video_pad|>"],
        vision_start_token_id=added["<|vision_start|>"],
        vision_end_token_id=added["<|vision_end|>"]))
