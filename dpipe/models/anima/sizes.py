"""Anima's configs for benchmarks with random weights (dpipe-bench --size).

"2b": the released model. Its transformer is Cosmos-Predict2-2B-Text2Image's (diffusers'
`convert_cosmos.py` "Cosmos-2.0-Diffusion-2B-Text2Image": 28 blocks, 16 heads of 128, MLP ratio
4, adaLN-LoRA 256, text width 1024, rope scale (1, 4, 4), the padding-mask channel); its adapter
is AnimaTextConditioner's defaults (6 blocks of width 1024 over Qwen3-0.6B's 1024-wide states,
16 heads, T5's 32128-token vocabulary, output padded to 512). A sample: a 1024x1024 image (16 x
128 x 128 latents, 4096 tokens) and a 512-token prompt, 100 tokens of it real. "tiny": the test
model's (`dpipe.models.anima.tiny`).
"""

from dpipe.models.anima.tiny import QWEN_DIM, TEXT_CONDITIONER, TRANSFORMER

_CLASSES = {"transformer": "CosmosTransformer3DModel", "text_conditioner": "AnimaTextConditioner"}

TRANSFORMER_2B = dict(
    in_channels=16, out_channels=16, num_attention_heads=16, attention_head_dim=128,
    num_layers=28, mlp_ratio=4.0, text_embed_dim=1024, adaln_lora_dim=256,
    max_size=(128, 240, 240), patch_size=(1, 2, 2), rope_scale=(1.0, 4.0, 4.0),
    concat_padding_mask=True, extra_pos_embed_type=None)
TEXT_CONDITIONER_2B = dict(
    source_dim=1024, target_dim=1024, model_dim=1024, num_layers=6, num_attention_heads=16,
    mlp_ratio=4.0, target_vocab_size=32128, use_self_attention=True, use_layer_norm=False,
    min_sequence_length=512)


def _sized(transformer: dict, conditioner: dict) -> dict:
    return {"_class_name": "AnimaDenoiser",
            "transformer": {"_class_name": _CLASSES["transformer"], **transformer},
            "text_conditioner": {"_class_name": _CLASSES["text_conditioner"], **conditioner}}


SIZES = {
    "2b": _sized(TRANSFORMER_2B, TEXT_CONDITIONER_2B),
    "tiny": _sized(TRANSFORMER, {**TEXT_CONDITIONER, "target_vocab_size": 256}),
}
SAMPLE_SHAPES = {
    "2b": {"latents": (16, 1, 128, 128), "text": 512, "valid": 100, "qwen_dim": 1024,
           "t5_vocab": 32128},
    "tiny": {"latents": (16, 1, 8, 8), "text": 512, "valid": 12, "qwen_dim": QWEN_DIM,
             "t5_vocab": 256},
}
