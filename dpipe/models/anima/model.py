"""What dpipe trains of Anima: the Cosmos transformer and its text adapter, as one module.

AnimaModularPipeline runs the adapter (AnimaTextConditioner) on the Qwen3 states and the T5 token
ids of each prompt before the denoising loop, and the transformer on its output. Since the adapter
trains (LoRA or full) it belongs to the denoiser here, not to the frozen encoders: `AnimaDenoiser`
holds both under the pipeline's component names, so every parameter is named as the pipeline's
LoRA loader names it (`transformer.transformer_blocks.0.attn1.to_q`,
`text_conditioner.blocks.0.self_attn.q_proj`) and `optim.param_groups` can give the adapter its
own learning rate with `match: ^text_conditioner\\.`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dpipe.errors import ModelLoadError
from dpipe.models.common.gguf_files import GGUF_SUFFIX, keep_quantized, read_gguf
from dpipe.models.single_file import in_load_dtypes, load_or_fail, read_single_file

ADAPTER_PREFIX = "llm_adapter."  # the adapter's keys in Anima's single file (ComfyUI's name)
# city96's converter and ggufy tell Anima's file by its Cosmos-Predict2 keys: its GGUFs carry
# `cosmos`, the adapter among the tensors.
GGUF_ARCHITECTURES = ("cosmos",)
COMPONENTS = ("transformer", "text_conditioner")


class AnimaDenoiser(nn.Module):
    """The transformer and the text adapter, as AnimaModularPipeline's `transformer` and
    `text_conditioner`."""

    def __init__(self, transformer: nn.Module, text_conditioner: nn.Module):
        super().__init__()
        self.transformer = transformer
        self.text_conditioner = text_conditioner

    @property
    def config(self):
        return self.transformer.config

    def set_attention_backend(self, backend: str) -> None:
        # The adapter's attention goes through diffusers' dispatcher; the Cosmos transformer's
        # processor calls PyTorch's SDPA itself and keeps it.
        self.text_conditioner.set_attention_backend(backend)

    def forward(self, hidden_states, timestep, qwen_states, qwen_mask, t5_ids, t5_mask,
                padding_mask, fps=None):
        """As AnimaModularPipeline calls its two models for one prediction."""
        text = self.text_conditioner(source_hidden_states=qwen_states, target_input_ids=t5_ids,
                                     target_attention_mask=t5_mask, source_attention_mask=qwen_mask)
        return self.transformer(hidden_states=hidden_states, timestep=timestep,
                                encoder_hidden_states=text.to(hidden_states.dtype),
                                padding_mask=padding_mask, fps=fps, return_dict=False)[0]


def load_anima_denoiser(folder: Path, single_file: Path | None, dtype: torch.dtype) -> AnimaDenoiser:
    """From the diffusers folder's `transformer/` and `text_conditioner/`, or from Anima's single
    file or its GGUF (kept quantized), the configs from the folder."""
    from diffusers import AnimaTextConditioner, CosmosTransformer3DModel

    if single_file is not None:
        return _from_single_file(folder, single_file, dtype)
    transformer = load_or_fail(lambda: CosmosTransformer3DModel.from_pretrained(
        folder, subfolder="transformer", dtype=dtype), folder / "transformer")
    conditioner = load_or_fail(lambda: AnimaTextConditioner.from_pretrained(
        folder, subfolder="text_conditioner", dtype=dtype), folder / "text_conditioner")
    return AnimaDenoiser(transformer, conditioner)


def anima_skeleton(folder: Path, single_file: Path | None):
    """The denoiser with no weights read, each stage to read its own from the folder's
    `transformer/` and `text_conditioner/`, or from Anima's single file through its converter
    (`dpipe.models.stage_weights`); None where the folder holds no safetensors weights or the
    file is neither a safetensors nor a GGUF file (`reads_by_tensor`)."""
    from diffusers import AnimaTextConditioner, CosmosTransformer3DModel

    from dpipe.models.anima.comfyui import from_original
    from dpipe.models.single_file_weights import file_weights, reads_by_tensor
    from dpipe.models.stage_weights import (FolderWeights, empty_model, holds_safetensors,
                                            skeleton_of)

    if single_file is not None and not reads_by_tensor(single_file):
        return None
    if single_file is None and not all(holds_safetensors(folder / part) for part in COMPONENTS):
        return None
    denoiser = AnimaDenoiser(empty_model(CosmosTransformer3DModel, folder / "transformer"),
                             empty_model(AnimaTextConditioner, folder / "text_conditioner"))
    if single_file is None:
        weights = FolderWeights({f"{part}.": folder / part for part in COMPONENTS})
    else:
        weights = file_weights(single_file, denoiser,
                               lambda state, _: from_original(state, single_file), "Anima",
                               gguf_architectures=GGUF_ARCHITECTURES)
    return skeleton_of(denoiser, weights)


def _from_single_file(folder: Path, file: Path, dtype: torch.dtype) -> AnimaDenoiser:
    from accelerate import init_empty_weights
    from diffusers import AnimaTextConditioner, CosmosTransformer3DModel

    from dpipe.models.anima.comfyui import from_original

    gguf = file.suffix == GGUF_SUFFIX
    state = (read_gguf(file, "Anima", GGUF_ARCHITECTURES) if gguf
             else load_or_fail(lambda: read_single_file(file, dtype), file))
    with init_empty_weights():
        denoiser = AnimaDenoiser(
            CosmosTransformer3DModel.from_config(
                CosmosTransformer3DModel.load_config(folder / "transformer")),
            AnimaTextConditioner.from_config(
                AnimaTextConditioner.load_config(folder / "text_conditioner")))
    state = from_original(state, file)
    if gguf:  # its quantized Linears stay in their blocks; the rest dequantized to `dtype`
        state = keep_quantized(denoiser, state, file, dtype)
    expected = set(denoiser.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ModelLoadError(
            f"{file} does not fit the Anima model of {folder}: {len(missing)} weights missing "
            f"(e.g. {missing[:3]}), {len(unexpected)} the model lacks (e.g. {unexpected[:3]})")
    try:  # in `dtype` but for the transformer's float32 parts, as from_pretrained loads them
        denoiser.load_state_dict(in_load_dtypes(state, denoiser.transformer, dtype), strict=True,
                                 assign=True)
    except RuntimeError as err:  # sizes of another configuration
        raise ModelLoadError(f"{file} does not fit the Anima model of {folder}: {err}") from None
    return denoiser
