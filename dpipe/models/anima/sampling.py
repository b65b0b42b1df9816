"""Anima samples as AnimaModularPipeline's text-to-image blocks do: noise N(0, 1) of shape
(16, 1, h, w) from the seed's CPU generator; sigmas linspace(1, 1/steps, steps) through the
folder's FlowMatchEulerDiscreteScheduler (its fixed shift applied); the transformer at timestep
/ 1000 on the adapter's text, its output the flow velocity; classifier-free guidance
uncond + g (cond - uncond) (the pipeline's ClassifierFreeGuidance, 4.0) with the negative prompt
("" by default); 50 steps, the pipeline's default. Decoding: x * latents_std + latents_mean
through the Qwen-Image VAE, first frame.

The reference (`diffusers_sample`) is AnimaModularPipeline itself, loaded from the folder with the
trained transformer and text conditioner put in its place.
"""

from __future__ import annotations

import torch

from dpipe.models.common.cosmos import wan_vae_images
from dpipe.models.common.cosmos_padding import nearest_resize_without_torchvision
from dpipe.models.sampling import FamilySampling, SampleRequest


class AnimaSampling(FamilySampling):
    default_steps = 50
    default_guidance = 4.0

    def latent_shape(self, request: SampleRequest) -> tuple[int, ...]:
        v = self.spec.variant
        return (v.z_dim, 1, request.height // v.spatial, request.width // v.spatial)

    def load_vae(self, device: torch.device, dtype: torch.dtype):
        from diffusers import AutoencoderKLQwenImage

        vae = AutoencoderKLQwenImage.from_pretrained(self.path, subfolder="vae", dtype=dtype)
        return vae.to(device).requires_grad_(False).eval()

    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        return wan_vae_images(vae, latents)  # one frame: the image

    def diffusers_sample(self, denoiser, request: SampleRequest, steps: int,
                         guidance: float) -> torch.Tensor:
        from diffusers import AnimaModularPipeline, ClassifierFreeGuidance

        pipe = AnimaModularPipeline.from_pretrained(str(self.path))
        pipe.load_components(torch_dtype=torch.float32)
        pipe.update_components(transformer=denoiser.transformer,
                               text_conditioner=denoiser.text_conditioner,
                               guider=ClassifierFreeGuidance(guidance_scale=guidance))
        with nearest_resize_without_torchvision():
            return pipe(prompt=request.prompt, negative_prompt=request.negative_prompt,
                        height=request.height, width=request.width, num_inference_steps=steps,
                        max_sequence_length=self.spec.cfg.max_text_tokens,
                        generator=torch.Generator().manual_seed(request.seed), output="latents")
