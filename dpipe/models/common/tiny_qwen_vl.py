"""Tiny random Qwen vision-language models with the real models' structure at a small size: the
Qwen2.5-VL of Qwen-Image and OmniGen2 (`tiny_qwen25_vl`: a 2-layer language model of hidden
`text_dim` with grouped-query attention and multimodal RoPE, a 2-block vision tower with the real
14-pixel patches, window attention and 2x2 merging), and the Qwen3-VL of Krea 2, Ideogram 4 and
MiniMax H3 (`tiny_qwen3_vl_config`)."""

from __future__ import annotations

from pathlib import Path

from dpipe.models.common.shapes import round_up
from dpipe.models.common.tiny_qwen_tokenizer import QWEN2_VL_CHAT_TEMPLATE, save_qwen_tokenizer


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


def save_qwen25_vl_processor(directory: Path) -> dict[str, int]:
    """A Qwen2.5-VL processor folder as Qwen-Image-Edit's processor/ and OmniGen2's ship it: the
    tokenizer files, the image processor's preprocessor_config.json (the real Qwen2.5-VL pixel
    limits) and the chat template. Not reproduced: video_preprocessor_config.json (written by a
    video processor, which needs torchvision). Returns the tokenizer's {added token: id}."""
    from transformers import Qwen2VLImageProcessor

    added = save_qwen_tokenizer(directory, "qwen2.5-vl", model_max_length=131072)
    Qwen2VLImageProcessor(
        min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2, merge_size=2,
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711]).save_pretrained(directory)
    (directory / "chat_template.jinja").write_text(QWEN2_VL_CHAT_TEMPLATE)
    return added


def tiny_qwen3_vl_config(added: dict[str, int], text_dim: int, layers: int, mlp: int = 64,
                         vision_blocks: int = 2, **extra):
    """A `Qwen3VLConfig` at a small size, for the Qwen3-VL text encoders of Krea 2, Ideogram 4
    and MiniMax H3: a `layers`-layer language model (hidden `text_dim`, MLPs of `mlp`, heads of
    `mlp / 4` with interleaved multimodal RoPE) and a vision tower of `vision_blocks` blocks of
    width `mlp / 2` with the real 16-pixel patches and 2x2 merging, for the tokenizer whose
    added tokens are `added`. `extra`: further config keys (tie_word_embeddings)."""
    from transformers import Qwen3VLConfig

    head = mlp // 4
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=round_up(max(added.values()) + 1, 128), hidden_size=text_dim,
            intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=2,
            num_key_value_heads=1, head_dim=head, max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                             "mrope_section": [2, head // 4 - 1, head // 4 - 1],  # sum: head / 2
                             "mrope_interleaved": True},
            bos_token_id=added["<|endoftext|>"], eos_token_id=added["<|im_end|>"],
            pad_token_id=added["<|endoftext|>"]),
        vision_config=dict(
            depth=vision_blocks, hidden_size=mlp // 2, intermediate_size=mlp, num_heads=2,
            out_hidden_size=text_dim, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
            num_position_embeddings=64, deepstack_visual_indexes=[0]),
        image_token_id=added["<|image_pad|>"], video_token_id=added["<|video_pad|>"],
        vision_start_token_id=added["<|vision_start|>"],
        vision_end_token_id=added["<|vision_end|>"], **extra)
