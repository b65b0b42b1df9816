"""A tiny random SDXL base, written in the layout of stabilityai/stable-diffusion-xl-base-1.0.

The real repo holds the diffusers folders (`StableDiffusionXLPipeline`: EulerDiscreteScheduler with
SDXL's scaled-linear DDPM betas and epsilon prediction, UNet2DConditionModel, the SDXL VAE, CLIP-L
and OpenCLIP-bigG as CLIPTextModel / CLIPTextModelWithProjection, two CLIP tokenizers -- the second
pads with "!") and, at its root, the same weights as one single file `sd_xl_base_1.0.safetensors`
in Stability's own names. Both are written here, from the same weights, so single-file loading can
be checked against folder loading.

The UNet keeps SDXL's shape: three levels (DownBlock2D, then two CrossAttnDownBlock2D; up blocks
mirrored), two resnets per down block, more transformer layers deeper down, linear projections,
`text_time` conditioning on the pooled CLIP-G embedding and six size/crop numbers. The two text
encoders differ in width (32 and 48) as the real ones do (768 and 1280): diffusers' single-file
loader tells them apart by width.

Not reproduced: the fp16 `variant` files, the 0.9 VAE file, the real tokenizers' vocabularies.

Sizes: 64x64 images -> VAE (4x, 4 channels) -> 16x16 latents -> UNet levels 16, 8, 4.
"""

from __future__ import annotations

from pathlib import Path

from dpipe.models.common.tiny_vae import tiny_sdxl_vae
from dpipe.models.sdxl.ldm import single_file_state_dict, with_text_model_prefix
from dpipe.models.tiny_parts import (
    save_clip_tokenizer, seeded, tiny_clip_text_config, tiny_writer)

SINGLE_FILE = "sd_xl_base_1.0.safetensors"
CLIP_L_DIM, CLIP_G_DIM = 32, 48
TIME_DIM = 8  # addition_time_embed_dim (256 in SDXL)


@tiny_writer
def make_tiny_sdxl(out: Path, seed: int) -> None:
    """A tiny random SDXL folder (diffusers + single file)."""
    from diffusers import (
        EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel)
    from safetensors.torch import save_file
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    vocab = save_clip_tokenizer(out / "tokenizer")
    save_clip_tokenizer(out / "tokenizer_2", pad="!", pad_entry=True)
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
        beta_schedule="scaled_linear", prediction_type="epsilon", steps_offset=1,
        timestep_spacing="leading", interpolation_type="linear", use_karras_sigmas=False)

    with seeded(seed):
        text_encoder = CLIPTextModel(tiny_clip_text_config(vocab, CLIP_L_DIM))
    with seeded(seed + 1):
        text_encoder_2 = CLIPTextModelWithProjection(
            tiny_clip_text_config(vocab, CLIP_G_DIM, heads=3, act="gelu"))
    with seeded(seed + 2):
        unet = UNet2DConditionModel(
            sample_size=16, in_channels=4, out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(32, 64, 64), layers_per_block=2, norm_num_groups=8,
            transformer_layers_per_block=(1, 1, 2), attention_head_dim=(2, 4, 4),
            cross_attention_dim=CLIP_L_DIM + CLIP_G_DIM, use_linear_projection=True,
            addition_embed_type="text_time", addition_time_embed_dim=TIME_DIM,
            projection_class_embeddings_input_dim=6 * TIME_DIM + CLIP_G_DIM)
    with seeded(seed + 3):
        vae = tiny_sdxl_vae()

    scheduler.save_pretrained(out / "scheduler")
    unet.save_pretrained(out / "unet")
    vae.save_pretrained(out / "vae")
    for name, model in (("text_encoder", text_encoder), ("text_encoder_2", text_encoder_2)):
        model.save_pretrained(out / name)
        # As published (by transformers 4): names under `text_model.`, which transformers 5's
        # CLIP classes no longer write but still read.
        save_file(with_text_model_prefix(model.state_dict()), out / name / "model.safetensors",
                  metadata={"format": "pt"})
    pipe = StableDiffusionXLPipeline(
        vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
        tokenizer=CLIPTokenizer.from_pretrained(out / "tokenizer"),
        tokenizer_2=CLIPTokenizer.from_pretrained(out / "tokenizer_2"), unet=unet,
        scheduler=scheduler, force_zeros_for_empty_prompt=True)
    pipe.save_config(out)

    # The real file is fp16; the tiny keeps fp32 so folder and file compare exactly.
    save_file(single_file_state_dict(unet, vae, text_encoder, text_encoder_2), out / SINGLE_FILE)

