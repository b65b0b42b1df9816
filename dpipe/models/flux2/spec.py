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
the dataset's `control_dir`), they are appended after the noisy image tokens with their own ids
(t = 10, as Flux2Pipeline gives its first reference image), the model predicts for all tokens and
the loss reads only the target's. Without control latents it trains text-to-image.

Single files: model.path may name the transformer as one file in Black Forest Labs' layout
(`flux2-dev.safetensors`, with or without ComfyUI's `model.diffusion_model.` prefix), converted
by diffusers' own `convert_flux2_transformer_checkpoint_to_diffusers`; model.single_file_config
then names the diffusers folder for the VAE, text encoder and configs. LoRAs are written for
diffusers and for ComfyUI (BFL layout, q/k/v fused: see `common/bfl_layout.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from dpipe.diffusion.loss import weighted_mean
from dpipe.errors import ModelLoadError
from dpipe.models.common.bfl_layout import comfyui_lora, flux2_layout, save_bfl_file, source_format
from dpipe.models.diffusers_folder import check_folder, load_denoiser, load_encoders, read_json
from dpipe.models.fingerprint import folder_fingerprint
from dpipe.models.flux2.layers import Flux2DoubleBlock, Flux2SingleBlock, flux2_layers
from dpipe.models.lora_files import (
    DIFFUSERS_LORA, lora_scale, LoraFormat, peft_to_diffusers, save_diffusers_lora,
    write_lora_files)
from dpipe.models.single_file import check_single_file, load_or_fail, split_path
from dpipe.models.spec import ModelSpec, NoisedBatch, PipelineLayer, denoiser_config, block_costs

REQUIRED_PARTS = ("model_index.json", "transformer", "vae", "text_encoder", "tokenizer")
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


class Flux2Spec(ModelSpec):
    family = "flux2"

    def __init__(self, cfg):
        super().__init__(cfg)
        # model.path: the diffusers folder, or a single-file transformer in BFL's layout with
        # model.single_file_config naming the diffusers folder for the rest.
        self.path, self.single_file = split_path(cfg)

    def ensure_available(self) -> None:
        if self.cfg.tiny and not self.path.exists():
            from dpipe.models.flux2.tiny import make_tiny_flux2

            make_tiny_flux2(self.path)
        check_folder(self.path, REQUIRED_PARTS, "FLUX.2", "black-forest-labs/FLUX.2-dev")
        check_single_file(self.single_file)
        self._pipeline_class()
        self._vae_config()

    def _vae_config(self) -> dict[str, Any]:
        return read_json(self.path / "vae" / "config.json")

    def _pipeline_class(self):
        name = read_json(self.path / "model_index.json").get("_class_name")
        if name not in PIPELINES:
            raise ModelLoadError(
                f"model.path={self.path} holds a {name}, not a FLUX.2 pipeline "
                f"({' or '.join(PIPELINES)})")
        import diffusers

        return getattr(diffusers, name)

    @property
    def pixel_multiple(self) -> int:
        # VAE downscale (x8 for the real VAE), then the 2x2 patchify of the latents.
        return 2 ** (len(self._vae_config()["block_out_channels"]) - 1) * 2

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
        pipe = load_encoders(self._pipeline_class(), self.path, device, dtype,
                             frozen=("vae", "text_encoder"), tokenizer=None)
        pipe.tokenizer = tokenizer
        return pipe

    def load_denoiser(self, dtype: torch.dtype) -> nn.Module:
        from diffusers import Flux2Transformer2DModel

        return load_denoiser(Flux2Transformer2DModel, self.path, self.single_file, dtype,
                             convert=_from_bfl)

    def encoder_fingerprint(self, kind: str) -> dict[str, Any]:
        if kind == "image":
            return {
                "family": self.family,
                "vae": folder_fingerprint(self.path / "vae"),  # includes the BatchNorm stats
                "latent": "mode, 2x2 patchified, batch-norm normalised",
            }
        return {
            "family": self.family,
            "pipeline": read_json(self.path / "model_index.json").get("_class_name"),
            "text_encoder": folder_fingerprint(self.path / "text_encoder"),
            "tokenizer": folder_fingerprint(self.path / "tokenizer"),
            "max_text_tokens": self.cfg.max_text_tokens,
        }

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
    def lora_targets(self) -> str:
        return LORA_TARGETS

    def pipeline_layers(self, denoiser: nn.Module) -> list[PipelineLayer]:
        return flux2_layers(denoiser)

    def pipeline_layer_count(self) -> int:
        """flux2_layers: the embedding, every double- and single-stream block, the head."""
        double, single = denoiser_config(
            self.path / "transformer", "Flux2Transformer2DModel", "num_layers", "num_single_layers")
        return 2 + double + single

    def layer_costs(self, layers: list[PipelineLayer]) -> list[float]:
        return block_costs(layers, (Flux2DoubleBlock, Flux2SingleBlock))

    def make_inputs(self, batch: NoisedBatch):
        b, c, h, w = batch.latents.shape
        text = batch.text["text"]
        packed = _pack(batch.noisy)
        img_ids = _ids(t=0, h=h, w=w)
        control = getattr(batch, "control", None)  # (B, C, h', w') reference latents, or None
        if control is not None:
            packed = torch.cat([packed, _pack(control.to(packed.dtype))], dim=1)
            img_ids = torch.cat([img_ids, _ids(t=REFERENCE_T, h=control.shape[-2],
                                               w=control.shape[-1])], dim=0)
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
    def export_lora(self, state_dict: dict[str, torch.Tensor], metadata: dict[str, Any],
                    out_dir: Path) -> list[Path]:
        from diffusers import Flux2Pipeline

        weights = peft_to_diffusers(state_dict)
        return write_lora_files(
            out_dir, lambda: save_diffusers_lora(Flux2Pipeline, weights, metadata, out_dir),
            [LoraFormat(COMFYUI_LORA, lambda: comfyui_lora(weights, lora_scale(metadata), flux2_layout(
                read_json(self.path / "transformer" / "config.json"))), {"format": "comfyui"})])

    def export_full(self, shards: list[Path], out_dir: Path) -> Path:
        from dpipe.models.diffusers_folder import write_denoiser_folder

        folder = write_denoiser_folder(
            shards, out_dir / "transformer", self.path / "transformer" / "config.json")
        if self.single_file is not None:  # also in the layout it came in, named, typed and
            # prefixed as the source, so tools that loaded that file load the fine-tune the same way
            prefix, dtype = source_format(self.single_file)
            save_bfl_file(folder, out_dir / self.single_file.name, prefix, dtype)
        return folder

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        packed, t, text, guidance, txt_ids, img_ids = inputs
        return denoiser(
            hidden_states=packed, encoder_hidden_states=text, timestep=t,
            guidance=guidance if denoiser.config.guidance_embeds else None,
            txt_ids=txt_ids, img_ids=img_ids, return_dict=False)[0]

    def load_denoiser_with_lora(self, lora_dir: Path) -> nn.Module:
        pipe = self._pipeline_class().from_pretrained(
            self.path, text_encoder=None, vae=None, tokenizer=None,
            transformer=self.load_denoiser(torch.float32))
        pipe.load_lora_weights(str(lora_dir), weight_name=DIFFUSERS_LORA)
        return pipe.transformer

    def load_exported_full(self, export_dir: Path) -> nn.Module:
        from diffusers import Flux2Transformer2DModel

        return Flux2Transformer2DModel.from_pretrained(export_dir / "transformer")

    def sampling(self):
        from dpipe.models.flux2.sampling import Flux2Sampling

        return Flux2Sampling(self)


def _from_bfl(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """BFL-named FLUX.2 weights -> diffusers names, by diffusers' own converter (it reads no
    sizes, so it serves any FLUX.2 width). It fails with a KeyError on a block weight it has no
    name for: reported as the file not being a FLUX.2 checkpoint."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    try:
        return convert_flux2_transformer_checkpoint_to_diffusers(dict(state))
    except KeyError as err:
        raise ValueError(f"not a FLUX.2 transformer in BFL's layout: no diffusers name for the "
                         f"block weight {err}") from None


def _pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h*w, C), as Flux2Pipeline._pack_latents."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def _ids(t: int, h: int, w: int) -> torch.Tensor:
    """(h*w, 4) position ids (t, row, column, 0), as Flux2Pipeline._prepare_latent_ids and
    _prepare_image_ids build them."""
    return torch.cartesian_prod(torch.tensor([t]), torch.arange(h), torch.arange(w),
                                torch.tensor([0]))
