"""Qwen-Image-Edit-2509 and -2511: Qwen-Image-Edit with up to three reference images per sample.

Loads the diffusers folder layout of Qwen/Qwen-Image-Edit-2509 and Qwen/Qwen-Image-Edit-2511 (both
`QwenImageEditPlusPipeline`; the 2511 transformer sets `zero_cond_t`, which the layers follow:
`dpipe.models.qwen_image.layers`). What differs from Qwen-Image-Edit, following the pipeline:

* Each reference's VAE latents are packed and appended after the target's tokens, in order, each
  with its own RoPE grid at frame index 1, 2, 3 (the transformer's `img_shapes`: the target, then
  every reference); the prediction is read from the target's tokens only.
* The Qwen2.5-VL encoder reads every reference with the instruction: the template gets
  "Picture 1: <vision tokens>Picture 2: ..." before the instruction, each image resized to about
  384x384 pixels at its aspect ratio (the pipeline's CONDITION_IMAGE_SIZE).
* A sample takes as many references as its files give, 1 to 3 (`references`); a micro-batch holds
  samples with as many each.

In training the references are fitted to the target's bucket as every control image is; the
pipeline (and dpipe's sampler) VAE-encodes them at ~1 MP (`QwenImageEditSampling.control_size`).
"""

from __future__ import annotations

from typing import Any

import torch

from dpipe.errors import DataError, ModelLoadError
from dpipe.models.diffusers_folder import read_json
from dpipe.models.qwen_image.edit import QwenImageEditSpec
from dpipe.models.qwen_image.layers import image_grids, text_inputs
from dpipe.models.common.latent_packing import pack, packed_labels
from dpipe.models.spec import NoisedBatch, reference_latents


class QwenImageEditPlusSpec(QwenImageEditSpec):
    family = "qwen_image_edit_plus"
    pipeline_class = "QwenImageEditPlusPipeline"
    title, example = "Qwen-Image-Edit-2509 / 2511", "Qwen/Qwen-Image-Edit-2511"
    text_notes = {**QwenImageEditSpec.text_notes,
                  "image": "every reference, resized to ~384x384 pixels as the pipeline does"}
    tiny_writer = "dpipe.models.qwen_image.tiny:make_tiny_qwen_image_edit_plus"
    sampler = "dpipe.models.qwen_image.sampling:QwenImageEditPlusSampling"
    references = 3  # the model card's "1 to 3 input images"

    @staticmethod
    def prompt_image_area() -> int:
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

        return plus.CONDITION_IMAGE_SIZE  # 384 * 384

    def read_configs(self) -> None:
        super().read_configs()
        # Qwen-Image-Edit's folder has the same parts: only model_index.json tells them apart.
        name = read_json(self.path / "model_index.json").get("_class_name")
        if name != self.pipeline_class:
            raise ModelLoadError(
                f"model.path={self.path} holds a {name}, not Qwen-Image-Edit-2509/2511 "
                f"({self.pipeline_class}); for Qwen-Image-Edit use model=qwen_image_edit")

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts_with_controls(self, encoders: Any, prompts: list[str],
                                     controls: torch.Tensor) -> dict[str, torch.Tensor]:
        # One prompt at a time: the pipeline numbers the pictures of one prompt ("Picture 1:
        # ..."), so a batch of prompts with their references cannot go in one call.
        embeds = []
        for prompt, refs in zip(prompts, controls):
            images = [self.prompt_image(encoders, r) for r in (refs[None] if refs.dim() == 3
                                                                else refs)]
            one, _mask = encoders.encode_prompt([prompt], image=images,
                                                device=encoders.vae.device)
            embeds.append(one[0])  # a batch of one has no padding
        longest = max(e.shape[0] for e in embeds)
        padded = torch.stack([torch.cat([e, e.new_zeros(longest - e.shape[0], e.shape[1])])
                              for e in embeds])
        mask = torch.stack([torch.arange(longest) < e.shape[0] for e in embeds]).long()
        return self._padded(padded, mask)

    # ---- training ----------------------------------------------------------------------------
    def make_inputs(self, batch: NoisedBatch):
        control = getattr(batch, "control", None)
        if control is None:
            raise DataError(f"model.family={self.family} trains on (references, target) pairs: "
                            "give the dataset a control_dir with a same-stem control image (or "
                            "<stem>_1, <stem>_2, ...) per file")
        b, c, h, w = batch.latents.shape
        refs = [r.to(batch.noisy.dtype) for r in reference_latents(control)]
        shapes = image_grids((1, h // 2, w // 2),
                             *((1, r.shape[-2] // 2, r.shape[-1] // 2) for r in refs))
        inputs = (pack(batch.noisy), batch.timesteps, *text_inputs(batch.text), shapes,
                  torch.cat([pack(r) for r in refs], dim=1))
        return inputs, packed_labels(batch)
