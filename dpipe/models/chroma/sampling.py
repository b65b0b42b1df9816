"""Chroma samples as `ChromaPipeline` does: FLUX.1's noise and packing, sigmas 1 -> 1/steps shifted
by the image's token count, real classifier-free guidance (scale 5.0, the negative prompt as a
second prediction), 35 steps; latents unpacked from 2x2 patches, un-scaled and decoded by the KL
VAE.

Text masking: Chroma attends to the prompt's tokens plus one padding token and to no other
padding. dpipe's `make_inputs` cuts the text after that token (nothing is left to mask at one
prompt per micro-batch). diffusers 0.42.1's ChromaPipeline instead hands the transformer its
mask as floats, which scaled_dot_product_attention adds to the scores (+1 for kept tokens, +0 for
padding) instead of masking them (huggingface/diffusers#12116), so with the prompt given as text
it attends to all the padding. The reference run therefore gives the pipeline the prompts'
embeddings from its own `encode_prompt`, cut the same way, with an all-ones mask (a constant
added to every score: no change); see `diffusers_sample`.
"""

from __future__ import annotations

import torch

from dpipe.models.common.latent_packing import unpack
from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest


class ChromaSampling(FamilySampling):
    default_steps = 35  # ChromaPipeline's num_inference_steps
    default_guidance = 5.0  # its guidance_scale (real CFG where > 1)
    guidance_kind = "cfg"

    def prediction(self, output: torch.Tensor, d: Denoising) -> torch.Tensor:
        return unpack(output.float(), d.latents)

    def diffusers_sample(self, denoiser, request: SampleRequest, steps: int,
                         guidance: float) -> torch.Tensor:
        from diffusers import ChromaPipeline

        pipe = ChromaPipeline.from_pretrained(self.path, transformer=denoiser,
                                              dtype=torch.float32)

        def embed(prompt: str) -> dict[str, torch.Tensor]:
            text, _ids, mask, *_ = pipe.encode_prompt(
                prompt, device=pipe._execution_device, do_classifier_free_guidance=False,
                max_sequence_length=self.spec.cfg.max_text_tokens)
            kept = int(mask[0].sum())  # the prompt and its one attended padding token
            return text[:, :kept], torch.ones(1, kept, dtype=text.dtype)

        text, mask = embed(request.prompt)
        kwargs = {}
        if guidance > 1:
            negative, negative_mask = embed(request.negative_prompt)
            kwargs = {"negative_prompt_embeds": negative,
                      "negative_prompt_attention_mask": negative_mask}
        packed = pipe(prompt_embeds=text, prompt_attention_mask=mask, height=request.height,
                      width=request.width, num_inference_steps=steps, guidance_scale=guidance,
                      max_sequence_length=self.spec.cfg.max_text_tokens,
                      generator=torch.Generator().manual_seed(request.seed),
                      output_type="latent", **kwargs).images
        return unpack(packed, torch.empty(1, *self.latent_shape(request)))
