"""A tiny random Cosmos 1.0 Text2World model, written in the layout of the
nvidia/Cosmos-1.0-Diffusion-7B-Text2World diffusers repo.

Tests and CI cannot download the real checkpoint, so they run the real loading code
(`CosmosTextToWorldPipeline.from_pretrained`, `CosmosTransformer3DModel.from_pretrained(subfolder=...)`)
on this folder. Kept as in the real repo (diffusers' scripts/convert_cosmos_to_diffusers.py writes
it): the pipeline class and components in model_index.json, the EDMEulerScheduler config
(sigma 0.002..80, sigma_data 0.5, Karras rho 7, epsilon preconditioning, final sigma sigma_min),
a T5 v1.0 encoder (T5-11B's, d_model 1024 in the real one) with a T5 tokenizer, the Cosmos CV8x8x8
VAE (AutoencoderKLCosmos: 8x temporal and spatial compression, Haar patches, latent statistics
per channel and latent frame, 16 x 16 values), a transformer with the learnable absolute position
embedding (`extra_pos_embed_type="learnable"`), the padding-mask channel and Cosmos 1.0's rope
scale (2, 1, 1); sharded transformer and T5 weights with index files, stored in bf16. Only the
sizes shrink. No safety checker is stored: the pipeline builds `CosmosSafetyChecker` (the
cosmos_guardrail package) itself.

Sizes: 64x64 images -> 8x8 latents -> 2x2 patches -> 16 tokens per latent frame; 9 frames -> 2
latent frames.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dpipe.models.common.tiny_files import save_parts, save_sharded
from dpipe.models.cosmos1.sizes import COSMOS1_TINY
from dpipe.models.tiny_parts import (
    save_t5_tokenizer, seeded, tiny_t5_encoder, tiny_writer, write_config)

TEXT_DIM = 32  # T5 d_model = the transformer's text_embed_dim (1024 in the real model)
TEXT_MAX_LENGTH = 512
PIPELINE = "CosmosTextToWorldPipeline"
# The real scheduler config (diffusers' convert_cosmos_to_diffusers.py, Cosmos 1.0).
SCHEDULER = dict(sigma_min=0.002, sigma_max=80.0, sigma_data=0.5, sigma_schedule="karras",
                 num_train_timesteps=1000, prediction_type="epsilon", rho=7.0,
                 final_sigmas_type="sigma_min")


@tiny_writer
def make_tiny_cosmos1(out: Path, seed: int) -> None:
    """A tiny random Cosmos 1.0 Text2World folder."""
    from diffusers import AutoencoderKLCosmos, CosmosTransformer3DModel, EDMEulerScheduler

    vocab = save_t5_tokenizer(out / "tokenizer", model_max_length=TEXT_MAX_LENGTH)
    with seeded(seed):
        text_encoder = tiny_t5_encoder(vocab, TEXT_DIM, d_ff=64, v1_1=False)  # T5-11B's: v1.0
    with seeded(seed + 1):
        # The real CV8x8x8 VAE's layout with narrow blocks; its latent statistics (the class
        # defaults, Cosmos-1.0-Tokenizer-CV8x8x8's mean_std.pt) kept.
        vae = AutoencoderKLCosmos(
            latent_channels=16, encoder_block_out_channels=(8, 8, 8, 8),
            decode_block_out_channels=(8, 8, 8, 8), attention_resolutions=(8,), resolution=64,
            num_layers=1, patch_size=4, patch_type="haar", spatial_compression_ratio=8,
            temporal_compression_ratio=8)
    with seeded(seed + 2):
        transformer = CosmosTransformer3DModel.from_config(COSMOS1_TINY)
        # The learnable position embedding starts at zero in diffusers; random values keep its
        # path (and its gradient) visible in the tests.
        for param in transformer.learnable_pos_embed.parameters():
            torch.nn.init.normal_(param)

    save_parts(out, save_sharded, torch.bfloat16, EDMEulerScheduler(**SCHEDULER),
               text_encoder=(text_encoder, 2), vae=(vae, 1), transformer=(transformer, 2))
    write_config(out / "model_index.json", {
        "_class_name": PIPELINE,
        "_diffusers_version": "0.33.0.dev0",
        "safety_checker": [None, None],
        "scheduler": ["diffusers", "EDMEulerScheduler"],
        "text_encoder": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", "T5TokenizerFast"],
        "transformer": ["diffusers", "CosmosTransformer3DModel"],
        "vae": ["diffusers", "AutoencoderKLCosmos"],
    })


# Buffers and heads of NVIDIA's training code in its Cosmos 1.0 checkpoints (model.pt), which
# diffusers' converter drops: the rope's position table and the log-variance head of the loss.
_TRAINING_EXTRAS = {"pos_embedder.seq": (128,), "logvar.0.freqs": (128,),
                    "logvar.0.phases": (128,), "logvar.1.weight": (1, 128)}


def write_single_file(folder: Path, file: Path, prefix: str = "net.") -> Path:
    """The tiny folder's transformer in NVIDIA's Cosmos 1.0 layout (`net.blocks.block0.blocks.0.
    block.attn.to_q.0.weight`, ...), with the training buffers, bf16; `prefix` "" writes the
    names without `net.`. A .safetensors file, or a .pt (a plain state dict, torch.save)."""
    from dpipe.models.cosmos1.original import original_state_dict
    from dpipe.models.single_file import write_transformer_file

    extras = {prefix + name: torch.zeros(shape) for name, shape in _TRAINING_EXTRAS.items()}
    # Transformer Engine's metadata of an attention module, as NVIDIA's checkpoints carry it
    extras[prefix + "blocks.block0.blocks.0.block.attn.attn_op._extra_state"] = torch.zeros(
        4, dtype=torch.uint8)
    return write_transformer_file(Path(folder) / "transformer", file, original_state_dict, prefix,
                                  torch.bfloat16, extras, format_metadata=False)
