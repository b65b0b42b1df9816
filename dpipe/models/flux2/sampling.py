"""FLUX.2 samples as its diffusers pipeline does (`Flux2Pipeline` for FLUX.2-dev,
`Flux2KleinPipeline` for the Klein models, read from model_index.json).

Noise is drawn in the pipeline's pre-packing shape, the 2x2-patchified latents (4x the VAE's
channels, at 1/16 of the pixel size for the real VAE), which is also the layout the training
cache holds; the transformer sees one token per position. Sigmas run from 1 to 1/steps and are
shifted by FLUX.2's `compute_empirical_mu`, which depends on the token count *and* the number of
steps (not the scheduler's linear `calculate_shift`). Guidance: FLUX.2-dev is guidance-distilled
(the scale, 4.0 by default, is the model's input: "embedded"); Klein takes no guidance input and
runs real classifier-free guidance with a negative prompt (the pipeline's default negative prompt
is ""), except for the step-distilled Klein models (`is_distilled`), which take none. Reference
images (edit sampling: a request with a `control`, one path or several) arrive as `d.control`,
appended after the image tokens by `make_inputs` with t = 10, 20, ... as the pipeline does; their
predictions are dropped. Decoding
undoes the VAE's BatchNorm normalisation and the 2x2 patchify, then runs the VAE decoder.

Each reference image is used at the request's size (fitted as training fits control images); the
pipeline uses a given image at its own size (shrunk to 1024x1024 pixels' area where larger), so
the reference run is given the image already fitted, and equals dpipe's then. The pipeline
refuses reference images under 64 pixels a side; dpipe takes them.
"""

from __future__ import annotations

import torch

from dpipe.models.common.vae_batch_norm import batch_norm_stats, decoded_patches
from dpipe.models.diffusers_folder import read_json
from dpipe.models.sampling import Denoising, FamilySampling, SampleRequest


def unpack(packed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B, h*w, C) -> (B, C, h, w) shaped as `like`: Flux2Pipeline's packing undone (its ids are
    the regular grid, so `_unpack_latents_with_ids` is this reshape)."""
    b, c, h, w = like.shape
    return packed[:, : h * w].permute(0, 2, 1).reshape(b, c, h, w)


class Flux2Sampling(FamilySampling):
    default_steps = 50  # both pipelines' num_inference_steps
    default_guidance = 4.0  # both pipelines' guidance_scale
    takes_control = True  # a reference image, where a request gives one (an edit)

    @property
    def pipeline_name(self) -> str:
        return read_json(self.path / "model_index.json")["_class_name"]

    def reference_class(self, request: SampleRequest) -> str:
        return self.pipeline_name

    @property
    def guidance_kind(self) -> str:
        if self.pipeline_name == "Flux2KleinPipeline":
            # Real CFG, but not for the step-distilled models (the pipeline ignores the scale).
            distilled = read_json(self.path / "model_index.json").get("is_distilled", False)
            return "none" if distilled else "cfg"
        # Flux2Pipeline passes the scale to the transformer, which uses it where it embeds it.
        config = read_json(self.path / "transformer" / "config.json")
        return "embedded" if config.get("guidance_embeds", True) else "none"

    # ---- latents -----------------------------------------------------------------------------
    def latent_shape(self, request: SampleRequest) -> tuple[int, ...]:
        """(4C, H/2f, W/2f): the patchified latents, as `Flux2Pipeline.prepare_latents` draws them
        (channels = the transformer's in_channels = 4x the VAE's latent channels)."""
        vae = self.vae_config()
        factor = 2 ** (len(vae["block_out_channels"]) - 1) * 2
        channels = read_json(self.path / "transformer" / "config.json")["in_channels"]
        return (channels, request.height // factor, request.width // factor)

    # ---- the schedule ------------------------------------------------------------------------
    def shift_mu(self, scheduler, latents: torch.Tensor, steps: int | None = None) -> float:
        """FLUX.2's mu; at `default_steps` where no step count is given (for training's
        `shift=auto`, which samples no steps)."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        tokens = latents.shape[-2] * latents.shape[-1]  # one token per position
        return compute_empirical_mu(image_seq_len=tokens, num_steps=steps or self.default_steps)

    def set_timesteps(self, scheduler, steps: int, latents: torch.Tensor) -> torch.Tensor:
        import numpy as np

        sigmas = np.linspace(1.0, 1 / steps, steps)
        if scheduler.config.get("use_flow_sigmas"):
            sigmas = None
        mu = self.shift_mu(scheduler, latents, steps)
        scheduler.set_timesteps(steps if sigmas is None else None, sigmas=sigmas,
                                device=latents.device, mu=mu)
        return scheduler.timesteps

    # ---- one step ----------------------------------------------------------------------------
    def prediction(self, output: torch.Tensor, d: Denoising) -> torch.Tensor:
        return unpack(output.float(), d.latents)  # reference tokens (edits) dropped

    # ---- decoding ----------------------------------------------------------------------------
    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """As the pipeline's decode: BatchNorm statistics undone, 2x2 patches unfolded."""
        from diffusers import Flux2Pipeline

        return decoded_patches(vae, latents, Flux2Pipeline._unpatchify_latents)

    # ---- the reference -----------------------------------------------------------------------
    def reference_parts(self, denoiser, request: SampleRequest) -> dict:
        # The tokenizer alone, as `Flux2Spec.load_encoders` loads it (`load_reference`):
        # FLUX.2-dev names a PixtralProcessor, which needs torchvision to build and of which
        # only the text tokenizer is used.
        return {"tokenizer": None}

    def load_reference(self, denoiser, request: SampleRequest):
        from transformers import AutoTokenizer

        pipe = super().load_reference(denoiser, request)
        pipe.tokenizer = AutoTokenizer.from_pretrained(self.path / "tokenizer")
        return pipe

    def reference_arguments(self, pipe, request: SampleRequest, steps: int,
                            guidance: float) -> dict:
        arguments = super().reference_arguments(pipe, request, steps, guidance)
        del arguments["negative_prompt"]
        if request.control is not None:  # an edit: the reference images fitted to the size
            arguments["image"] = [self.fitted(path, request) for path in request.controls]
        if self.guidance_kind == "cfg" and guidance > 1:
            # Klein takes no negative prompt text (it encodes ""): give it the request's, encoded
            # by the pipeline's own encoder.
            arguments["negative_prompt_embeds"] = pipe.encode_prompt(
                request.negative_prompt, device=pipe._execution_device,
                max_sequence_length=self.spec.cfg.max_text_tokens)[0]
        return arguments

    def reference_latents(self, pipe, packed: torch.Tensor,
                          request: SampleRequest) -> torch.Tensor:
        if packed.ndim == 4:
            # Flux2KleinPipeline's "latent" output is the VAE's: BatchNorm statistics undone and
            # unpatchified. Back to the sampler's layout, as `_encode_vae_image` does it.
            mean, std = batch_norm_stats(pipe.vae)
            return ((pipe._patchify_latents(packed) - mean.to(packed.dtype))
                    / std.to(packed.dtype))
        return unpack(packed, torch.empty(1, *self.latent_shape(request)))
