"""What HunyuanVideo and HunyuanVideo 1.5 share (`HunyuanVideoFamily`): a folder of the same parts
(a VAE whose config names its compression, two text encoders), images as 1-frame clips with the
video loss, single files in Tencent's original / ComfyUI layout and their GGUFs, and a ComfyUI
LoRA in the names ComfyUI gives the original modules."""

from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch

from dpipe.diffusion.loss import video_loss
from dpipe.models.comfyui import to_comfyui
from dpipe.models.common.clips import EncodesClips
from dpipe.models.common.comfyui_hunyuan import comfyui_module
from dpipe.models.common.key_tables import FINAL_MODULATION
from dpipe.models.family import SINGLE_FILE_SUFFIXES, DiffusersFamily
from dpipe.models.lora_files import LoraFormat, lora_scale


class HunyuanVideoFamily(EncodesClips, DiffusersFamily):
    required_parts = ("model_index.json", "transformer", "vae", "text_encoder", "text_encoder_2",
                      "tokenizer", "tokenizer_2", "scheduler")
    frozen_parts = ("vae", "text_encoder", "text_encoder_2")
    vae_config_keys = ("scaling_factor",)
    error_loss = video_loss  # mask weights broadcast over the frames too
    single_file_suffixes = SINGLE_FILE_SUFFIXES
    gguf_architectures = ("hyvid",)  # ComfyUI-GGUF names both HunyuanVideos so
    # The ComfyUI LoRA file's name, and `comfyui_mapping(transformer config, diffusers-named
    # LoRA weights)`: (ComfyUI module, the diffusers modules it stacks, their output sizes) for
    # every Linear holding a module with a LoRA.
    comfyui_lora: ClassVar[str]
    comfyui_mapping: ClassVar[Callable[..., Any]]
    # ComfyUI renames a single file's keys on loading (its HunyuanVideo code): the name of a
    # file's module there, which LoRAs made for ComfyUI address (`lora_names`)
    comfyui_file_module = staticmethod(comfyui_module)

    @property
    def pixel_multiple(self) -> int:
        # The VAE's config names its downscale; the transformer's patches on top.
        return (self.part_config("vae")["spatial_compression_ratio"]
                * self.part_config("transformer")["patch_size"])

    @property
    def temporal_ratio(self) -> int:
        return self.part_config("vae")["temporal_compression_ratio"]

    def lora_formats(self, weights: dict[str, torch.Tensor],
                     metadata: dict[str, Any]) -> list[LoraFormat]:
        mapping = type(self).comfyui_mapping  # the function itself, not bound to self
        return [LoraFormat(self.comfyui_lora, lambda: to_comfyui(
            weights, lora_scale(metadata), mapping(self.part_config("transformer"), weights),
            swapped=FINAL_MODULATION), {"format": "comfyui"})]
