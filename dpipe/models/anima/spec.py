"""Anima (circlestone-labs): Cosmos-Predict2-2B-Text2Image's transformer conditioned through a
trained text adapter (AnimaTextConditioner, the "LLM adapter") on Qwen3-0.6B, with the Qwen-Image
VAE; text-to-image. Cosmos-Predict2's layers, latents and key names (`dpipe.models.common.cosmos*`)
are its own.

Prompts, as AnimaModularPipeline's text-encoder step makes them (its own `encode_prompt`): the
Qwen3 encoder's last hidden states of the prompt (zeroed after it) with their mask, and the
prompt's T5 token ids with theirs, each cut at `model.max_text_tokens` (512, the pipeline's) and
padded to it. The adapter that turns them into the transformer's 512 text tokens trains with the
transformer (LoRA targets include it by default; a full fine-tune trains it), on the first
pipeline stage; `optim.param_groups=[{match: '^text_conditioner\\.', lr: ...}]` gives it its own
learning rate.

Objective. The pipeline hands the transformer x_t at timestep sigma (scheduler timestep / 1000),
with no EDM preconditioning (unlike Cosmos-Predict2's pipelines), and steps a flow-matching Euler
scheduler on its output: the output is the velocity noise - x0 at t = sigma, dpipe's default
flow-matching objective as is. Latents: the VAE's mean, (z - latents_mean) / latents_std, as the
pipeline's decoder inverts it.

Weights: the diffusers folder (circlestone-labs/Anima-Base-v1.0-Diffusers, a modular-pipeline
folder with modular_model_index.json), or Anima's single file (circlestone-labs/Anima,
split_files/diffusion_models/*.safetensors: the transformer under NVIDIA's names and the adapter
under `llm_adapter.`), or its GGUF (`cosmos`: kept quantized), with that folder as
model.single_file_config.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dpipe.errors import DataError, ModelLoadError
from dpipe.models.anima.comfyui import lora_to_comfyui, original_state_dict
from dpipe.models.anima.layers import AnimaEmbed, anima_layers
from dpipe.models.anima.model import (
    COMPONENTS, GGUF_ARCHITECTURES, AnimaDenoiser, anima_skeleton, load_anima_denoiser)
from dpipe.models.anima.sizes import SAMPLE_SHAPES, SIZES
from dpipe.models.common.clips import EncodesClips
from dpipe.models.common.cosmos import BLOCK_LINEARS, EDGE_LAYER_COST, Predict2Folder
from dpipe.models.common.cosmos_layers import CosmosBlock
from dpipe.models.common.cosmos_padding import nearest_resize_without_torchvision
from dpipe.models.diffusers_folder import load_or_fail, wan_vae_latents, write_denoiser_folder
from dpipe.models.family import DiffusersFamily
from dpipe.models.lora_files import (
    DIFFUSERS_LORA, lora_scale, LoraFormat, peft_to_diffusers, write_lora_files)
from dpipe.models.single_file import export_like_source
from dpipe.models.spec import NoisedBatch, PipelineLayer, attention_train_flops, model_params
from dpipe.models.sync_free import carrier

REPO = "circlestone-labs/Anima-Base-v1.0-Diffusers"
INDEX = "modular_model_index.json"
PIPELINE = "AnimaModularPipeline"
REQUIRED_PARTS = (INDEX, "transformer", "text_conditioner", "text_encoder", "tokenizer",
                  "t5_tokenizer", "vae", "scheduler")
COMFYUI_LORA = "anima_lora_comfyui.safetensors"
T5_PAD_ID = 0  # T5's <pad>

# Every Linear of the transformer's blocks (as Cosmos-Predict2's LoRAs) and of the adapter's
# blocks (attention and MLP): a peft regex over AnimaDenoiser's module names.
_ADAPTER_LINEARS = [r"(?:self_attn|cross_attn)\.[qkvo]_proj", r"mlp\.[02]"]
LORA_TARGETS = (r"transformer\.transformer_blocks\.\d+\.(?:" + "|".join(BLOCK_LINEARS) + ")"
                r"|text_conditioner\.blocks\.\d+\.(?:" + "|".join(_ADAPTER_LINEARS) + ")")
# Relative cost of the adapter in stage balancing: its tokens (the prompt's, padded to 512)
# against a 1024x1024 image's 4096 in the transformer's blocks.
TEXT_TOKENS, IMAGE_TOKENS = 512, 4096


class AnimaSpec(Predict2Folder, EncodesClips, DiffusersFamily):
    family = "anima"
    title, example = "Anima", REPO
    pipeline_class, denoiser_class = PIPELINE, "CosmosTransformer3DModel"
    pipeline_in_index = False  # its index is INDEX, checked to name PIPELINE (read_configs)
    index_file, required_parts = INDEX, REQUIRED_PARTS
    other_folder_advice = {"Cosmos2": "train Cosmos-Predict2 with model=cosmos_predict2"}
    text_fingerprint = {"qwen3": "text_encoder", "tokenizer": "tokenizer",
                        "t5_tokenizer": "t5_tokenizer"}
    vae_config_keys = ("latents_mean", "latents_std")
    tiny_writer = "dpipe.models.anima.tiny:make_tiny_anima"
    lora_modules = LORA_TARGETS
    layers = anima_layers
    sampler = "dpipe.models.anima.sampling:AnimaSampling"
    single_file_suffixes = (".safetensors",)
    gguf_architectures = GGUF_ARCHITECTURES

    def read_configs(self) -> None:
        super().read_configs()
        config = self.part_config("transformer")
        if config.get("extra_pos_embed_type") or config.get("img_context_dim_in"):
            raise ModelLoadError(f"{self.path / 'transformer'} is not Anima's Cosmos-Predict2 "
                                 "transformer (Cosmos 1.0 or 2.5 options are set)")
        self.i2v  # noqa: B018 - refuses model.i2v=true: Anima is text-to-image

    # ---- components -------------------------------------------------------------------------
    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        """The pipeline's text-encoder step components (Qwen3, its tokenizer, the T5 tokenizer)
        and the VAE."""
        from diffusers import AutoencoderKLQwenImage
        from transformers import AutoTokenizer, Qwen3Model

        p = self.path
        tokenizer = load_or_fail(lambda: AutoTokenizer.from_pretrained(p / "tokenizer"), p / "tokenizer")
        t5_tokenizer = load_or_fail(lambda: AutoTokenizer.from_pretrained(p / "t5_tokenizer"),
                                    p / "t5_tokenizer")
        text_encoder = load_or_fail(lambda: Qwen3Model.from_pretrained(
            p / "text_encoder", dtype=dtype), p / "text_encoder")
        vae = load_or_fail(lambda: AutoencoderKLQwenImage.from_pretrained(
            p, subfolder="vae", dtype=dtype), p / "vae")
        for module in (text_encoder, vae):
            module.requires_grad_(False).eval().to(device)
        return SimpleNamespace(tokenizer=tokenizer, t5_tokenizer=t5_tokenizer,
                               text_encoder=text_encoder, vae=vae, _execution_device=device)

    # Its own load_denoiser joins two models, and its own skeleton too: each stage reads its
    # own weights (`loads_stage_weights`).
    def load_denoiser(self, dtype: torch.dtype) -> nn.Module:
        return load_anima_denoiser(self.path, self.single_file, dtype)

    def denoiser_skeleton(self):
        return anima_skeleton(self.path, self.single_file)

    # ---- caching -----------------------------------------------------------------------------
    def encode_images(self, encoders: Any, pixels: torch.Tensor) -> torch.Tensor:
        # A dataset's clips reach it too (EncodesClips), to be refused naming Anima.
        if pixels.ndim == 5 and pixels.shape[2] > 1:
            raise DataError(f"Anima is an image model: it takes no {pixels.shape[2]}-frame "
                            "clips; give images")
        return wan_vae_latents(encoders.vae, pixels.unsqueeze(2) if pixels.ndim == 4 else pixels)

    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        """AnimaTextEncoderStep.encode_prompt's outputs, each padded to max_text_tokens."""
        from diffusers.modular_pipelines.anima.encoders import AnimaTextEncoderStep

        n = self.cfg.max_text_tokens
        out = AnimaTextEncoderStep.encode_prompt(
            encoders, prompts, prepare_unconditional_embeds=False, max_sequence_length=n,
            device=encoders.text_encoder.device, dtype=encoders.text_encoder.dtype)

        def padded(x: torch.Tensor, value=0) -> torch.Tensor:
            pad = [0, 0] * (x.ndim - 2) + [0, n - x.shape[1]]
            return F.pad(x, pad, value=value)

        return {"qwen": padded(out["qwen_prompt_embeds"]),
                "qwen_mask": padded(out["qwen_attention_mask"].long()),
                "t5_ids": padded(out["t5_input_ids"].long(), T5_PAD_ID),
                "t5_mask": padded(out["t5_attention_mask"].long())}

    # ---- training ----------------------------------------------------------------------------
    def layer_costs(self, layers: list[PipelineLayer]) -> list[float]:
        """A block is 1; the head a few Linears (0.02); the first layer adds the adapter, whose
        blocks' weights run over the prompt's 512 tokens where a transformer block's run over
        a 1024x1024 image's 4096: its parameters against a block's, times 512 / 4096."""
        block = next(layer for layer in layers if isinstance(layer, CosmosBlock))
        block_params = sum(p.numel() for p in block.parameters())
        costs = []
        for layer in layers:
            if isinstance(layer, CosmosBlock):
                costs.append(1.0)
            elif isinstance(layer, AnimaEmbed):
                adapter = sum(p.numel() for p in layer.text_conditioner.blocks.parameters())
                costs.append(EDGE_LAYER_COST + adapter / block_params * TEXT_TOKENS / IMAGE_TOKENS)
            else:
                costs.append(EDGE_LAYER_COST)
        return costs

    def make_inputs(self, batch: NoisedBatch):
        latents, hidden, target = batch.latents, batch.noisy, batch.target
        t = batch.timesteps.to(latents.dtype)
        frames, height, width = latents.shape[2:]
        _, p_h, p_w = self.variant.patch
        grid = carrier(frames, height // p_h, width // p_w, 0)
        text = batch.text
        # The cache stores every text entry as float: ids and masks back to integers (exact:
        # T5's 32128 ids are far below fp32's 2^24).
        inputs = (hidden, t, text["qwen"], text["qwen_mask"].long(), text["t5_ids"].long(),
                  text["t5_mask"].long(), grid)
        weight = getattr(batch, "loss_weight", None)  # masks, (B, 1, 1, h, w), or None
        return inputs, (target,) if weight is None else (target, weight)

    # ---- benchmarks ----------------------------------------------------------------------------
    bench_configs = SIZES

    def random_denoiser(self, size: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
        from diffusers import AnimaTextConditioner, CosmosTransformer3DModel

        config = self.bench_configs[size]
        with torch.device(device):
            model = AnimaDenoiser(CosmosTransformer3DModel.from_config(config["transformer"]),
                                  AnimaTextConditioner.from_config(config["text_conditioner"]))
        return model.to(dtype)

    def random_sample(self, size: str):
        shapes = SAMPLE_SHAPES[size]
        n, valid = shapes["text"], shapes["valid"]
        mask = torch.zeros(n, dtype=torch.long)
        mask[:valid] = 1
        ids = torch.randint(1, shapes["t5_vocab"], (n,)) * mask
        qwen = torch.randn(n, shapes["qwen_dim"]) * mask[:, None]
        return torch.randn(shapes["latents"]), {"qwen": qwen, "qwen_mask": mask,
                                                "t5_ids": ids, "t5_mask": mask.clone()}

    def bench_folder(self, size: str) -> dict[str, dict[str, Any]]:
        """The size's transformer and the Qwen-Image VAE (8x, 4x in time): its `variant`."""
        t = self.bench_configs[size]["transformer"]
        return {"transformer/config.json": t, "vae/config.json": {
            "z_dim": t["out_channels"], "temperal_downsample": [False, True, True]}}

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        """6 (full) or 4 (LoRA) x parameters x tokens: the transformer's over the image tokens,
        the adapter's over its 512 text tokens; plus attention (the blocks' self-attention over
        the image and cross-attention to the text; the adapter's self- and cross-attention)."""
        latents, _t, qwen = inputs[:3]
        c, a = denoiser.transformer.config, denoiser.text_conditioner.config
        p_t, p_h, p_w = c.patch_size
        seq = latents.shape[2] // p_t * (latents.shape[3] // p_h) * (latents.shape[4] // p_w)
        text = max(a.min_sequence_length, inputs[4].shape[1])
        width = c.num_attention_heads * c.attention_head_dim
        k = 6 if full else 4
        attention = c.num_layers * (attention_train_flops(seq, width)
                                    + attention_train_flops(seq, width, text))
        attention += a.num_layers * (attention_train_flops(text, a.model_dim)
                                     + attention_train_flops(text, a.model_dim, qwen.shape[1]))
        return latents.shape[0] * (k * model_params(denoiser.transformer) * seq
                                   + k * model_params(denoiser.text_conditioner) * text
                                   + attention)

    # ---- export ------------------------------------------------------------------------------
    def export_lora(self, state_dict: dict[str, torch.Tensor], metadata: dict[str, Any],
                    out_dir: Path) -> list[Path]:
        weights = peft_to_diffusers(state_dict)
        return write_lora_files(out_dir, lambda: save_anima_lora(weights, metadata, out_dir),
                                weights, metadata, self.lora_formats)

    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        return [LoraFormat(COMFYUI_LORA, lambda: lora_to_comfyui(weights, lora_scale(metadata)),
                           {"format": "comfyui"})]

    def export_full(self, shards: list[Path], out_dir: Path) -> Path:
        """`out_dir/transformer` and `out_dir/text_conditioner`, diffusers folders with the base
        model's configs; from a single file, also that file's layout (`out_dir/<its name>`)."""
        from safetensors.torch import load_file, save_file

        parts: dict[str, list[Path]] = {c: [] for c in COMPONENTS}
        with tempfile.TemporaryDirectory(dir=out_dir.parent) as tmp:
            for i, shard in enumerate(shards):
                tensors = load_file(shard)
                for component in COMPONENTS:
                    mine = {k.removeprefix(f"{component}."): v for k, v in tensors.items()
                            if k.startswith(f"{component}.")}
                    if mine:
                        part = Path(tmp) / f"{component}-{i:05d}.safetensors"
                        save_file(mine, part)
                        parts[component].append(part)
            out_dir.mkdir(parents=True, exist_ok=True)
            for component, files in parts.items():
                write_denoiser_folder(files, out_dir / component,
                                     self.path / component / "config.json")
            if self.single_file is not None:
                merged = Path(tmp) / "merged"
                merged.mkdir()
                weights = {}
                for component in COMPONENTS:
                    for f in sorted((out_dir / component).glob("*.safetensors")):
                        weights.update({f"{component}.{k}": v for k, v in load_file(f).items()})
                save_file(weights, merged / "model.safetensors")
                export_like_source(merged, self.single_file, original_state_dict, out_dir)
        return out_dir / "transformer"

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        """As AnimaModularPipeline calls its models: the adapter, then the transformer with a zero
        padding mask at pixel size."""
        hidden, t, qwen, qwen_mask, t5_ids, t5_mask, grid = inputs
        spatial = self.variant.spatial
        padding_mask = hidden.new_zeros(1, 1, hidden.shape[-2] * spatial,
                                        hidden.shape[-1] * spatial)
        with nearest_resize_without_torchvision():
            return denoiser(hidden, t, qwen, qwen_mask, t5_ids, t5_mask, padding_mask)

    def load_denoiser_with_lora(self, lora_dir: Path, weight_name: str | None = None) -> nn.Module:
        """As diffusers users load an Anima LoRA: AnimaModularPipeline's `load_lora_weights`
        (AnimaLoraLoaderMixin), into both its transformer and its text conditioner."""
        denoiser = self.load_denoiser(torch.float32)
        load_lora_like_pipeline(denoiser, lora_dir, weight_name or DIFFUSERS_LORA, self.path)
        return denoiser

    def load_exported_full(self, export_dir: Path) -> nn.Module:
        return load_anima_denoiser(export_dir, None, torch.float32)


def _component_metadata(metadata: dict[str, Any], modules: list[str]) -> dict[str, Any]:
    """The adapter config of one component: its trained modules by name (peft matches a list
    entry as a name suffix; the spec's regex is over AnimaDenoiser's names)."""
    return {**metadata, "target_modules": sorted(set(modules))}


def save_anima_lora(weights: dict[str, torch.Tensor], metadata: dict[str, Any],
                    out_dir: Path) -> Path:
    """The diffusers LoRA file AnimaModularPipeline loads: `transformer.*` and
    `text_conditioner.*` weights, each component's adapter config in the metadata under its
    name, as diffusers' LoRA savers pack them."""
    from diffusers.loaders.lora_pipeline import AnimaLoraLoaderMixin

    layers: dict[str, dict[str, torch.Tensor]] = {}
    modules: dict[str, list[str]] = {}
    for key, value in weights.items():
        component, _, name = key.partition(".")
        if component not in COMPONENTS:
            raise KeyError(f"LoRA weight {key!r} is outside Anima's transformer and adapter")
        layers.setdefault(component, {})[name] = value
        modules.setdefault(component, []).append(name.rsplit(".lora", 1)[0].rsplit(".lok", 1)[0]
                                                 .rsplit(".hada", 1)[0])
    AnimaLoraLoaderMixin._save_lora_weights(
        save_directory=out_dir, lora_layers=layers,
        lora_metadata={c: _component_metadata(metadata, modules[c]) for c in layers},
        weight_name=DIFFUSERS_LORA)
    return out_dir / DIFFUSERS_LORA


def load_lora_like_pipeline(denoiser: AnimaDenoiser, lora_dir: Path, weight_name: str,
                           folder: Path) -> None:
    """`AnimaModularPipeline.load_lora_weights`, on the folder's pipeline holding the two models
    (its other components play no part in loading a LoRA and stay unloaded)."""
    from diffusers import AnimaModularPipeline

    pipe = AnimaModularPipeline.from_pretrained(str(folder))
    pipe.update_components(transformer=denoiser.transformer,
                           text_conditioner=denoiser.text_conditioner)
    pipe.load_lora_weights(str(lora_dir), weight_name=weight_name)
