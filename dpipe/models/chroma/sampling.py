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
added to every score: no change); see `reference_arguments`.
"""

from __future__ import annotations

import torch

from dpipe.models.sampling import FamilySampling, SampleRequest


class ChromaSampling(FamilySampling):
    default_steps = 35  # ChromaPipeline's num_inference_steps
    default_guidance = 5.0  # its guidance_scale (real CFG where > 1)
    guidance_kind = "cfg"
    packed = True
    reference_pipeline = "ChromaPipeline"

    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        """The prompts as the pipeline's own embeddings, cut as dpipe cuts them."""
        def embed(prompt: str) -> dict[str, torch.Tensor]:
            text, _ids, mask, *_ = pipe.encode_prompt(
                prompt, device=pipe._execution_device, do_classifier_free_guidance=False,
                max_sequence_length=self.spec.cfg.max_text_tokens)
            kept = int(mask[0].sum())  # the prompt and its one attended padding token
            return text[:, :kept], torch.ones(1, kept, dtype=text.dtype)

        arguments = super().reference_arguments(pipe, request, steps, guidance)
        del arguments["prompt"], arguments["negative_prompt"]
        arguments["prompt_embeds"], arguments["prompt_attention_mask"] = embed(request.prompt)
        if guidance > 1:
            (arguments["negative_prompt_embeds"],
             arguments["negative_prompt_attention_mask"]) = embed(request.negative_prompt)
        return arguments
