"""FLUX.2 (dev, and the Klein variants): Flux2Transformer2DModel + AutoencoderKLFlux2 + an LLM text
encoder (FLUX.2-dev: Mistral Small 3.1 as Mistral3ForConditionalGeneration; Klein: Qwen3).

Loads the diffusers folder layout users download (black-forest-labs/FLUX.2-dev, or a FLUX.2
[klein] folder: the pipeline class is read from model_index.json). Text and images are encoded by
the diffusers pipeline's own code: prompts through its chat template and the LLM, whose hidden
states of three layers are stacked (dev: 10, 20, 30); images through the VAE (distribution mode),
2x2-patchified to 4x the latent channels and normalised by the VAE's BatchNorm statistics. The
transformer sees those latents as one token per position (no further packing), with 4-axis
position ids (t, h, w, l). Objective: rectified flow, t in [0, 1] (the model scales it by 1000);
FLUX.2-dev embeds `model.guidance` as its distilled guidance.

Edit training (reference images): when a batch carries control latents (`batch.control`, from
the dataset's `control_dir`: one reference or several, in order), they are appended after the
noisy image tokens, each with its own ids (t = 10 + 10 * i for reference i, as Flux2Pipeline's
`_prepare_image_ids`), the model predicts for all tokens and the loss reads only the target's.
Without control latents it trains text-to-image.

Single files: model.path may name the transformer as one file in Black Forest Labs' layout
(`flux2-dev.safetensors`, with or without ComfyUI's `model.diffusion_model.` prefix), converted
by diffusers' own `convert_flux2_transformer_checkpoint_to_diffusers`; model.single_file_config
then names the diffusers folder for the VAE, text encoder and configs. LoRAs are written for
diffusers and for ComfyUI (BFL layout, q/k/v fused: see `common/bfl_layout.py`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpipe.diffusion.loss import weighted_mean
from dpipe.errors import ModelLoadError
from dpipe.models.common.bfl_layout import comfyui_lora, flux2_layout, save_like_source
from dpipe.models.diffusers_folder import load_encoders, read_json
from dpipe.models.family import SINGLE_FILE_SUFFIXES, DiffusersFamily, diffusers_class
from dpipe.models.flux2.layers import Flux2DoubleBlock, Flux2SingleBlock, flux2_layers
from dpipe.models.lora_files import LoraFormat, lora_scale
from dpipe.models.single_file import load_or_fail
from dpipe.models.spec import NoisedBatch, reference_latents

PIPELINES = ("Flux2Pipeline", "Flux2KleinPipeline")
REFERENCE_T = 10  # Flux2Pipeline._prepare_image_ids: reference image i gets t = 10 + 10 * i

# Every Linear of both kinds of blocks. FLUX.2's modulations are computed outside the blocks (three
# shared Linears), so, as in the community's FLUX.2 LoRAs, they are not adapted.
_DOUBLE_LINEARS = [
    r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0",
    r"attn\.add_q_proj", r"attn\.add_k_proj", r"attn\.add_v_proj", r"attn\.to_add_out",
    r"ff\.linear_in", r"ff\.linear_out", r"ff_context\.linear_in", r"ff_context\.linear_out",
]
# Single blocks fuse q, k, v and the MLP input into one Linear, and attention out + MLP out into
# another (there `attn.to_out` is a Linear; in double blocks it is a ModuleList).
_SINGLE_LINEARS = [r"attn\.to_qkv_mlp_proj", r"attn\.to_out"]
COMFYUI_LORA = "flux2_lora_comfyui.safetensors"
LORA_TARGETS = (r"transformer_blocks\.\d+\.(?:" + "|".join(_DOUBLE_LINEARS) + ")"
                + r"|single_transformer_blocks\.\d+\.(?:" + "|".join(_SINGLE_LINEARS) + ")")


def from_bfl_file(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """BFL-named FLUX.2 weights -> diffusers names, by diffusers' own converter (it reads no
    sizes, so it serves any FLUX.2 width). It fails with a KeyError on a block weight it has no
    name for: reported as the file not being a FLUX.2 checkpoint."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    try:
        return convert_flux2_transformer_checkpoint_to_diffusers(dict(state))
    except KeyError as err:
        raise ValueError(f"not a FLUX.2 transformer in BFL's layout: no diffusers name for the "
                         f"block weight {err}") from None


class Flux2Spec(DiffusersFamily):
    family = "flux2"
    title, example = "FLUX.2", "black-forest-labs/FLUX.2-dev"
    denoiser_class = "Flux2Transformer2DModel"
    required_parts = ("model_index.json", "transformer", "vae", "text_encoder", "tokenizer")
    vae_config_keys = ()  # the VAE's files hold its BatchNorm statistics
    image_notes = {"latent": "mode, 2x2 patchified, batch-norm normalised"}
    latent_patch = 2
    tiny_writer = "dpipe.models.flux2.tiny:make_tiny_flux2"
    lora_modules = LORA_TARGETS
    layers, block_count_keys = flux2_layers, ("num_layers", "num_single_layers")
    block_types = (Flux2DoubleBlock, Flux2SingleBlock)
    sampler = "dpipe.models.flux2.sampling:Flux2Sampling"
    # Reference images per edit sample: the pipeline sets no limit; 10 is what Black Forest Labs
    # gives for FLUX.2 [dev] (each adds its token count to the sequence).
    references = 10
    lora_writer = "Flux2Pipeline"  # for Klein folders too: the same file
    single_file_suffixes = SINGLE_FILE_SUFFIXES
    # ComfyUI-GGUF's loader lists no FLUX.2 name: its GGUFs carry FLUX.1's, or their own.
    gguf_architectures = ("flux", "flux2")
    from_single_file = from_bfl_file

    @property
    def pipeline_class(self) -> str:
        """FLUX.2-dev's pipeline or Klein's, as model_index.json names it."""
        name = read_json(self.path / "model_index.json").get("_class_name")
        if name not in PIPELINES:
            raise ModelLoadError(
                f"model.path={self.path} holds a {name}, not a FLUX.2 pipeline "
                f"({' or '.join(PIPELINES)})")
        return name

    @property
    def text_notes(self) -> dict[str, Any]:
        # dev and Klein encode prompts with different LLMs and templates
        return {"pipeline": read_json(self.path / "model_index.json").get("_class_name")}

    def read_configs(self) -> None:
        self.pipeline_class  # a folder of another pipeline fails here, before the VAE's config
        super().read_configs()

    # ---- components -------------------------------------------------------------------------
    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        # FLUX.2-dev names a PixtralProcessor as its tokenizer; building one needs torchvision,
        # while only its text tokenizer (and chat template) is ever used here: load that alone.
        from transformers import AutoTokenizer

        tokenizer = load_or_fail(lambda: AutoTokenizer.from_pretrained(self.path / "tokenizer"),
                                 self.path / "tokenizer")
        if tokenizer.chat_template is None:
            raise ModelLoadError(f"{self.path / 'tokenizer'} has no chat template "
                                 "(chat_template.jinja), which FLUX.2 prompts are built with")
        pipe = load_encoders(diffusers_class(self.pipeline_class), self.path, device, dtype,
                             frozen=self.frozen_parts, tokenizer=None)
        pipe.tokenizer = tokenizer
        return pipe

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        vae = encoders.vae
        # The pipeline's own reference-image encoder: VAE mode, patchify, BatchNorm-normalise.
        return encoders._encode_vae_image(pixels.to(vae.device, vae.dtype), generator=None)

    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        text, _ids = encoders.encode_prompt(prompts, device=encoders.vae.device,
                                            max_sequence_length=self.cfg.max_text_tokens)
        return {"text": text}

    # ---- training ----------------------------------------------------------------------------
    def make_inputs(self, batch: NoisedBatch):
        b, c, h, w = batch.latents.shape
        text = batch.text["text"]
        packed = _pack(batch.noisy)
        img_ids = _ids(t=0, h=h, w=w)
        control = getattr(batch, "control", None)  # reference latents, or None
        if control is not None:
            refs = reference_latents(control)
            packed = torch.cat([packed, *(_pack(r.to(packed.dtype)) for r in refs)], dim=1)
            img_ids = torch.cat([img_ids, *(_ids(t=REFERENCE_T * (i + 1), h=r.shape[-2],
                                                 w=r.shape[-1]) for i, r in enumerate(refs))])
        txt_ids = torch.zeros(text.shape[1], 4, dtype=torch.long)
        txt_ids[:, 3] = torch.arange(text.shape[1])
        guidance = getattr(batch, "guidance", None)  # set when sampling
        if guidance is None:
            guidance = torch.full((b,), float(self.cfg.guidance))
        inputs = (packed, batch.timesteps, text, guidance, txt_ids, img_ids)
        weight = getattr(batch, "loss_weight", None)  # (B, 1, h, w) from masks, or None
        if weight is None:
            return inputs, (_pack(batch.target),)
        return inputs, (_pack(batch.target), _pack(weight.expand(b, 1, h, w)))

    def loss(self, outputs, labels) -> torch.Tensor:
        target = labels[0]
        pred = outputs[:, :target.shape[1]]  # reference image tokens (edit training) carry no loss
        # labels[1:]: per-token loss weights (masks), broadcast over channels, where given
        return weighted_mean(self.element_error(pred, target), *labels[1:])

    def prior_labels(self, outputs: torch.Tensor, labels: tuple, rows: list[int]) -> tuple:
        # without the reference image tokens, as `loss`
        return super().prior_labels(outputs[:, :labels[0].shape[1]], labels, rows)

    # ---- export ------------------------------------------------------------------------------
    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        return [LoraFormat(COMFYUI_LORA, lambda: comfyui_lora(
            weights, lora_scale(metadata), flux2_layout(self.part_config("transformer"))),
            {"format": "comfyui"})]

    def export_single_file(self, folder, out_dir):
        # BFL's layout in the source's prefix and dtype, as the FLUX families always wrote it.
        return save_like_source(folder, self.single_file, out_dir)

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        packed, t, text, guidance, txt_ids, img_ids = inputs
        return denoiser(
            hidden_states=packed, encoder_hidden_states=text, timestep=t,
            guidance=guidance if denoiser.config.guidance_embeds else None,
            txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]


def _pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h*w, C), as Flux2Pipeline._pack_latents."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def _ids(t: int, h: int, w: int) -> torch.Tensor:
    """(h*w, 4) position ids (t, row, column, 0), as Flux2Pipeline._prepare_latent_ids and
    _prepare_image_ids build them."""
    return torch.cartesian_prod(torch.tensor([t]), torch.arange(h), torch.arange(w),
                                torch.tensor([0]))
