"""FLUX.1 Kontext [dev]: image editing with FLUX.1's components (FluxTransformer2DModel,
AutoencoderKL 16 ch, CLIP-L + T5-XXL), trained on (target, reference image, instruction) triples.

Its own family (`flux_kontext`) rather than a switch on `flux`: its checkpoints load with
FluxKontextPipeline (which is what users load its LoRAs with), its training samples need a
reference image, and everything else is FLUX.1's, inherited from `FluxSpec` unchanged (text and
image encoding, pipeline layers, LoRA targets, export incl. the ComfyUI LoRA, single-file loading
of `flux1-kontext-dev.safetensors` in BFL's layout).

The reference image is encoded by the same VAE as the target (the dataset's `control_dir`
delivers it as `batch.control`, latents shaped as the target's). As FluxKontextPipeline does, its
packed tokens are appended after the noisy target tokens, with position ids (1, row, column)
where the target's are (0, row, column); the reference stays clean (never noised) and the
transformer predicts all tokens, of which the loss reads the target's only.
"""

from __future__ import annotations

import warnings

import torch

from dpipe.errors import ModelLoadError
from dpipe.models.common.latent_packing import image_ids, pack
from dpipe.models.diffusers_folder import read_json
from dpipe.models.flux.spec import FluxSpec
from dpipe.models.spec import NoisedBatch


class FluxKontextSpec(FluxSpec):
    family = "flux_kontext"
    title, example = "FLUX.1 Kontext", "black-forest-labs/FLUX.1-Kontext-dev"
    pipeline_class = "FluxKontextPipeline"
    tiny_writer = "dpipe.models.flux.tiny:make_tiny_flux_kontext"
    sampler = "dpipe.models.flux.sampling:FluxKontextSampling"

    def read_configs(self) -> None:
        super().read_configs()
        # FLUX.1-dev's folder has the same parts: only model_index.json tells them apart.
        name = read_json(self.path / "model_index.json").get("_class_name")
        if name != self.pipeline_class:
            raise ModelLoadError(
                f"model.path={self.path} holds a {name}, not FLUX.1 Kontext "
                f"({self.pipeline_class}); for FLUX.1-dev or schnell use model=flux")

    def make_inputs(self, batch: NoisedBatch):
        inputs, labels = super().make_inputs(batch)
        control = getattr(batch, "control", None)  # (B, C, h, w) reference latents, or None
        if control is None:
            warnings.warn("FLUX.1 Kontext trains without reference images: give the dataset a "
                          "control_dir to train edits", stacklevel=2)
            return inputs, labels
        packed, t, text, pooled, guidance, txt_ids, img_ids = inputs
        ref_ids = image_ids(control.shape[-2] // 2, control.shape[-1] // 2)
        ref_ids[:, 0] = 1
        packed = torch.cat([packed, pack(control.to(packed.dtype))], dim=1)
        img_ids = torch.cat([img_ids, ref_ids], dim=0)
        return (packed, t, text, pooled, guidance, txt_ids, img_ids), labels

    def loss(self, outputs, labels) -> torch.Tensor:
        # The reference image's tokens come last and carry no loss.
        return super().loss(outputs[:, :labels[0].shape[1]], labels)
