"""Qwen-Image-Edit: Qwen-Image trained on (control image, instruction) -> target image.

Loads the diffusers folder layout of Qwen/Qwen-Image-Edit. What differs from Qwen-Image, following
`QwenImageEditPipeline`:

* The reference image conditions twice. Its VAE latents (normalised as the target's, from the
  dataset's control image at the target's size) are packed and appended to the image tokens, with
  their own RoPE grid (frame index 1); the prediction is read from the target's tokens only.
* The Qwen2.5-VL encoder reads the image with the instruction (the edit template, whose first 64
  tokens are dropped; the image's vision tokens stay in the embedding). The image is first resized
  to about 1024x1024 pixels at its aspect ratio, as the pipeline does. Text entries therefore
  depend on the control image: `text_sees_control`, `encode_prompts_with_controls`.

Qwen-Image-Edit-2509 / 2511 (QwenImageEditPlusPipeline: several references, zero_cond_t) are
the family `qwen_image_edit_plus` (`edit_plus.py`).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from dpipe.errors import DataError
from dpipe.models.diffusers_folder import load_encoders
from dpipe.models.family import diffusers_class
from dpipe.models.qwen_image.layers import image_grids, text_inputs
from dpipe.models.common.latent_packing import pack, packed_labels
from dpipe.models.qwen_image.spec import REQUIRED_PARTS, QwenImageSpec
from dpipe.models.spec import NoisedBatch

log = logging.getLogger(__name__)


class QwenImageEditSpec(QwenImageSpec):
    family = "qwen_image_edit"
    pipeline_class = "QwenImageEditPipeline"
    title, example = "Qwen-Image-Edit", "Qwen/Qwen-Image-Edit"
    required_parts = REQUIRED_PARTS + ("processor",)
    text_fingerprint = {**QwenImageSpec.text_fingerprint, "processor": "processor"}
    text_notes = {**QwenImageSpec.text_notes,
                  "image": "control image, resized to ~1024x1024 pixels as the pipeline does"}
    tiny_writer = "dpipe.models.qwen_image.tiny:make_tiny_qwen_image_edit"
    sampler = "dpipe.models.qwen_image.sampling:QwenImageEditSampling"
    text_sees_control = True
    bench_configs = {}  # random samples carry no reference image (QwenImageSpec.random_sample)

    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        return load_encoders(diffusers_class(self.pipeline_class), self.path, device, dtype,
                             frozen=self.frozen_parts,
                             processor=load_processor(self.path / "processor"))

    def encoder_fingerprint(self, kind: str) -> dict[str, Any]:
        out = super().encoder_fingerprint(kind)
        if kind == "image":  # Qwen-Image's latents: its image cache entries serve the edit too
            out["family"] = QwenImageSpec.family
        return out

    # ---- caching -----------------------------------------------------------------------------
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        raise DataError(
            "model.family=qwen_image_edit encodes each instruction together with its control "
            "image; give the dataset a control_dir (the text cache must then be keyed by the "
            "control image: see docs/models.md, Qwen-Image-Edit)")

    @torch.no_grad()
    def encode_prompts_with_controls(self, encoders: Any, prompts: list[str],
                                     controls: torch.Tensor) -> dict[str, torch.Tensor]:
        images = [self.prompt_image(encoders, c) for c in controls]
        # The edit pipeline keeps the whole encoding (its max_sequence_length cuts nothing): the
        # image's ~1300 vision tokens and the instruction all condition the transformer.
        embeds, mask = encoders.encode_prompt(list(prompts), image=images,
                                              device=encoders.vae.device)
        return self._padded(embeds, mask)

    @staticmethod
    def prompt_image_area() -> int:
        """The pixel area at which the pipeline shows a control image to the VL encoder."""
        return 1024 * 1024

    @classmethod
    def prompt_image(cls, encoders: Any, pixels: torch.Tensor):
        """A control image (3, H, W) in [-1, 1] as the pipeline hands it to the VL encoder: a PIL
        image resized to `prompt_image_area` pixels (`calculate_dimensions`) at its aspect ratio."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions
        from PIL import Image

        array = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().byte()
        image = Image.fromarray(np.ascontiguousarray(array.permute(1, 2, 0).cpu().numpy()))
        width, height = calculate_dimensions(cls.prompt_image_area(), image.width / image.height)
        return encoders.image_processor.resize(image, height, width)

    # ---- training ----------------------------------------------------------------------------
    def make_inputs(self, batch: NoisedBatch):
        control = getattr(batch, "control", None)
        if control is None:
            raise DataError("model.family=qwen_image_edit trains on (control, target) pairs: give "
                            "the dataset a control_dir with a same-stem control image per file")
        b, c, h, w = batch.latents.shape
        hc, wc = control.shape[-2:]
        shapes = image_grids((1, h // 2, w // 2), (1, hc // 2, wc // 2))
        inputs = (pack(batch.noisy), batch.timesteps, *text_inputs(batch.text), shapes,
                  pack(control.to(batch.noisy.dtype)))
        return inputs, packed_labels(batch)


def load_processor(directory):
    """The Qwen2VLProcessor of processor/; without torchvision (which transformers 5's
    Qwen2VLProcessor needs for its video half) an equivalent for images and text."""
    from transformers import AutoImageProcessor, Qwen2Tokenizer, Qwen2VLProcessor

    try:
        return Qwen2VLProcessor.from_pretrained(directory)
    except ImportError as err:
        log.info("Qwen2VLProcessor unavailable (%s); using its image + text part", err)
    return ImageTextProcessor(AutoImageProcessor.from_pretrained(directory),
                              Qwen2Tokenizer.from_pretrained(directory))


def _processor_base():
    from transformers import ProcessorMixin

    return ProcessorMixin


class ImageTextProcessor(_processor_base()):
    """What QwenImageEditPipeline asks of its processor, as Qwen2VLProcessor does it: images
    through the image processor, each <|image_pad|> expanded to the image's merged patch count,
    then the tokenizer. (A ProcessorMixin for diffusers' component type check; ProcessorMixin's
    own __init__, which wants every declared sub-processor, is not run.)"""

    image_token = "<|image_pad|>"

    def __init__(self, image_processor, tokenizer):  # noqa: D107 - no super().__init__, see above
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.chat_template = None

    def __call__(self, text, images=None, padding=True, return_tensors="pt", **kwargs):
        from transformers import BatchFeature

        text = [text] if isinstance(text, str) else list(text)
        image_inputs = {}
        if images is not None:
            image_inputs = dict(self.image_processor(images=images, return_tensors="pt"))
            grid = image_inputs["image_grid_thw"]
            merge = self.image_processor.merge_size ** 2
            counts = iter(int(g.prod()) // merge for g in grid)
            placeholder = "<|placeholder|>"
            for i, t in enumerate(text):
                while self.image_token in t:
                    t = t.replace(self.image_token, placeholder * next(counts), 1)
                text[i] = t.replace(placeholder, self.image_token)
        text_inputs = self.tokenizer(text, padding=padding, return_tensors=return_tensors, **kwargs)
        return BatchFeature(data={**text_inputs, **image_inputs}, tensor_type=return_tensors)
