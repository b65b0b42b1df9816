"""The pipeline's `processor` (Qwen3VLProcessor) where transformers cannot build it.

transformers 5 builds Qwen3VLProcessor's video half with torchvision; without torchvision
`Qwen3VLProcessor.from_pretrained` fails. A text prompt (MiniMax H3's t2va presentation) needs only
the processor's token bookkeeping (`create_mm_token_type_ids`: 0 text, 1 image, 2 video), so
`load_processor` gives a Qwen3VLProcessor holding the tokenizer and the image processor with the
real token ids, the same answers for text and image presentations."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def load_processor(directory: Path):
    """processor/ as Qwen3VLProcessor, or without torchvision its text + image part."""
    from transformers import AutoImageProcessor, Qwen2Tokenizer, Qwen3VLProcessor

    try:
        return Qwen3VLProcessor.from_pretrained(directory)
    except ImportError as err:
        log.info("Qwen3VLProcessor unavailable (%s); using its text + image part", err)

    class TextImageProcessor(Qwen3VLProcessor):
        # ProcessorMixin's __init__ wants every declared sub-processor (the video one too): not run.
        def __init__(self, image_processor, tokenizer):  # noqa: D107
            self.image_processor = image_processor
            self.tokenizer = tokenizer
            self.chat_template = None
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            self.vision_start_token_id = tokenizer.convert_tokens_to_ids("<|vision_start|>")
            self.vision_end_token_id = tokenizer.convert_tokens_to_ids("<|vision_end|>")

    return TextImageProcessor(AutoImageProcessor.from_pretrained(directory),
                              Qwen2Tokenizer.from_pretrained(directory))
