"""A tiny random OmniGen2, written in the layout of OmniGen2/OmniGen2.

The folders the reference's `OmniGen2Pipeline.from_pretrained` reads (VectorSpaceLab/OmniGen2
pipeline_omnigen2.py: transformer, vae, scheduler, mllm, processor): model_index.json;
transformer/ (`OmniGen2Transformer2DModel`'s config.json and sharded safetensors); vae/ (FLUX's
AutoencoderKL design); mllm/ (`Qwen2_5_VLForConditionalGeneration`, transformers' real class);
processor/ (the Qwen2.5-VL tokenizer with its chat template, and the image processor's
preprocessor_config.json); scheduler/ (the reference's own FlowMatchEulerDiscreteScheduler config:
num_train_timesteps, dynamic_time_shift). bf16 safetensors, only the sizes shrink.

Sizes: 64x64 images -> VAE (8x, four levels as FLUX's; 4 latent channels, the real 16) -> 8x8
latents -> 2x2 patches -> 16 image tokens of width 48 (2 heads of 24, 1 key/value head as the real
grouped-query attention); text: Qwen2.5-VL (hidden 32 = text_feat_dim, 2 layers, a 2-block vision
tower). 1 context-, 1 noise- and 1 reference-image-refiner block, 2 main blocks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpipe.models.common.tiny_files import save_component
from dpipe.models.common.tiny_qwen_vl import save_qwen25_vl_processor, tiny_qwen25_vl
from dpipe.models.common.tiny_vae import tiny_flux_vae
from dpipe.models.omnigen2.sizes import LATENT_CHANNELS, OMNIGEN2_TINY, TEXT_DIM
from dpipe.models.tiny_parts import seeded, tiny_writer, write_config

DTYPE = torch.bfloat16
# model_index.json: the parts the reference's OmniGen2Pipeline registers. Its library entries are
# dpipe's reading of the reference code, not compared with the published file; dpipe reads the
# folders and transformer/config.json, never these entries.
MODEL_INDEX = {
    "_class_name": "OmniGen2Pipeline",
    "_diffusers_version": "0.33.1",
    "mllm": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "processor": ["transformers", "Qwen2_5_VLProcessor"],
    "scheduler": ["omnigen2", "FlowMatchEulerDiscreteScheduler"],
    "transformer": ["omnigen2", "OmniGen2Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.33.1",
             "dynamic_time_shift": True, "num_train_timesteps": 1000}


@tiny_writer
def make_tiny_omnigen2(out: Path, seed: int) -> None:
    """A tiny random OmniGen2 folder."""
    from dpipe.models.omnigen2.transformer import OmniGen2Transformer2DModel

    added = save_qwen25_vl_processor(out / "processor")
    with seeded(seed):
        mllm = tiny_qwen25_vl(added, TEXT_DIM)
    with seeded(seed + 1):
        config = {k: v for k, v in OMNIGEN2_TINY.items() if k != "_class_name"}
        transformer = OmniGen2Transformer2DModel(**config)
    with seeded(seed + 2):
        vae = tiny_flux_vae(LATENT_CHANNELS, levels=4)

    # The scheduler: the reference's own class, its config written as JSON.
    (out / "scheduler").mkdir()
    write_config(out / "scheduler" / "scheduler_config.json", SCHEDULER)
    save_component(transformer, out / "transformer", shards=2, dtype=DTYPE)
    save_component(mllm, out / "mllm", shards=2, dtype=DTYPE)
    save_component(vae, out / "vae", shards=1, dtype=DTYPE)
    write_config(out / "model_index.json", MODEL_INDEX)
