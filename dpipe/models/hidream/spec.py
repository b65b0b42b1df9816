"""HiDream-I1 (Full / Dev / Fast): HiDreamImageTransformer2DModel (sparse MoE) + the FLUX VAE +
two long-context CLIPs, T5-XXL and Llama-3.1-8B-Instruct.

`model.path` is the diffusers folder (HiDream-ai/HiDream-I1-Full layout). Llama-3.1-8B-Instruct is
not part of that repo: put it (a copy or a symlink of the Llama folder) at `text_encoder_4/` and
`tokenizer_4/` inside the model folder. The transformer may instead come from one file as
ComfyUI holds it (`hidream_i1_full_fp16.safetensors`: the original module names, which are
diffusers', with or without `model.diffusion_model.`): model.path names the file and
model.single_file_config the diffusers folder for the rest.

Rectified flow with HiDream's sign: the pipeline negates the transformer's output before its
scheduler step, so the transformer predicts x0 - noise (the negated velocity), and that is the
target here. Timesteps go in as the scheduler's (t * 1000). Prompts go through
`HiDreamImagePipeline.encode_prompt` (all four encoders padded to `model.max_text_tokens`): pooled
CLIP-L + CLIP-G projections, T5 states, and the stack of every Llama layer's hidden states, each
block reading its own. The MoE runs dpipe's sync-free forward (`moe.py`: every routed expert on
every token, weighted by the gate), which gives diffusers' output; its auxiliary load-balancing
loss is not added (diffusers computes and drops it too).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dpipe.diffusion.flow_matching import noisy_latents
from dpipe.errors import ModelLoadError
from dpipe.models.comfyui import renamed
from dpipe.models.diffusers_folder import load_encoders
from dpipe.models.family import SINGLE_FILE_SUFFIXES, DiffusersFamily
from dpipe.models.hidream import costs
from dpipe.models.hidream.layers import hidream_layers
from dpipe.models.hidream.sizes import SAMPLE_SHAPES, SIZES
from dpipe.models.lora_files import LoraFormat, lora_scale
from dpipe.models.single_file import load_or_fail
from dpipe.models.spec import NoisedBatch

LLAMA_PARTS = ("text_encoder_4", "tokenizer_4")
COMFYUI_FILE = "hidream_lora_comfyui.safetensors"
TEXT_PARTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4", "tokenizer",
              "tokenizer_2", "tokenizer_3", "tokenizer_4")

# Every Linear of both kinds of blocks: attention (image and text projections), every expert and
# the shared expert of the MoE feed-forwards, the text feed-forward, the AdaLN modulation. Not the
# routers (plain parameters), embedders, caption projections or the head.
LORA_TARGETS = (r"(?:double|single)_stream_blocks\.\d+\.block\.(?:"
                r"attn1\.(?:to_q|to_k|to_v|to_out)(?:_t)?"
                r"|ff_i\.(?:experts\.\d+|shared_experts)\.w[123]|ff_t\.w[123]|adaLN_modulation\.1)")


def from_original(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A single file's weights -> diffusers names, through diffusers' own converter: in 0.42.1
    it only strips ComfyUI's prefix (the original names are diffusers'), which the loader has
    done already; kept so a future converter's renames apply here too."""
    from diffusers.loaders.single_file_utils import convert_hidream_transformer_to_diffusers

    return convert_hidream_transformer_to_diffusers(dict(state))


class HiDreamSpec(DiffusersFamily):
    family = "hidream"
    title, example = "HiDream-I1", "HiDream-ai/HiDream-I1-Full"
    pipeline_class, denoiser_class = "HiDreamImagePipeline", "HiDreamImageTransformer2DModel"
    # Llama (LLAMA_PARTS) is not in the repo: checked apart, with how to link it in.
    required_parts = ("model_index.json", "transformer", "vae", "scheduler", "text_encoder",
                      "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2",
                      "tokenizer_3")
    frozen_parts = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4")
    text_fingerprint = {part: part for part in TEXT_PARTS}
    latent_patch = None  # the transformer's patch_size
    tiny_writer = "dpipe.models.hidream.tiny:make_tiny_hidream"
    lora_modules = LORA_TARGETS
    layers = hidream_layers
    block_count_keys = ("num_layers", "num_single_layers")
    sampler = "dpipe.models.hidream.sampling:HiDreamSampling"
    # A single file as ComfyUI holds it: the original names, which are diffusers'.
    single_file_suffixes = SINGLE_FILE_SUFFIXES
    gguf_architectures = ("hidream",)
    from_single_file, to_original = from_original, dict

    def read_configs(self) -> None:
        missing = [p for p in LLAMA_PARTS if not (self.path / p).exists()]
        if missing:
            raise ModelLoadError(
                f"{self.path} has no {' and no '.join(missing)}: HiDream's fourth text encoder, "
                "Llama-3.1-8B-Instruct, is not part of its repo. Link your copy in: "
                f"ln -s /models/Llama-3.1-8B-Instruct {self.path / 'text_encoder_4'} && "
                f"ln -s /models/Llama-3.1-8B-Instruct {self.path / 'tokenizer_4'}")
        super().read_configs()

    # ---- components -------------------------------------------------------------------------
    def load_encoders(self, device: torch.device, dtype: torch.dtype) -> Any:
        from diffusers import HiDreamImagePipeline
        from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

        # Llama-3's tokenizer.json is byte-level BPE: load it as written (transformers 5's
        # LlamaTokenizerFast would rebuild it SentencePiece-style and drop spaces).
        llama = load_or_fail(lambda: {
            "tokenizer_4": PreTrainedTokenizerFast.from_pretrained(self.path / "tokenizer_4"),
            "text_encoder_4": LlamaForCausalLM.from_pretrained(self.path / "text_encoder_4",
                                                               dtype=dtype),
        }, self.path)
        return load_encoders(HiDreamImagePipeline, self.path, device, dtype, **llama,
                             frozen=self.frozen_parts)

    # ---- caching -----------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, encoders: Any, prompts: list[str]) -> dict[str, torch.Tensor]:
        t5, _, llama, _, pooled, _ = encoders.encode_prompt(
            prompts, device=encoders.vae.device, do_classifier_free_guidance=False,
            max_sequence_length=self.cfg.max_text_tokens)
        # Llama's stack is (layers, B, L, D); the cache wants the batch first.
        return {"t5": t5, "llama": llama.transpose(0, 1), "pooled": pooled}

    # ---- training ----------------------------------------------------------------------------
    def noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor):
        return noisy_latents(x0, noise, t), x0 - noise  # HiDream predicts the negated velocity

    def layer_costs(self, layers) -> list[float]:
        """Modelled forward FLOPs (dpipe.models.hidream.costs) at a 1024x1024 image."""
        return costs.layer_forward_flops(layers, costs.NOMINAL_IMAGE_TOKENS,
                                         self.cfg.max_text_tokens)

    def make_inputs(self, batch: NoisedBatch):
        text = batch.text
        inputs = (batch.noisy, batch.timesteps * 1000.0, text["t5"],
                  text["llama"].transpose(0, 1).contiguous(), text["pooled"])
        weight = getattr(batch, "loss_weight", None)  # (B, 1, h, w) from masks, or None
        return inputs, (batch.target,) if weight is None else (batch.target, weight)

    # ---- export ------------------------------------------------------------------------------
    def lora_formats(self, weights, metadata) -> list[LoraFormat]:
        # ComfyUI (and diffusion-pipe) name HiDream LoRAs after the original model, whose module
        # names diffusers kept: `diffusion_model.<module>.lora_A/lora_B.weight`, no alpha, so the
        # scale alpha / rank is folded into lora_B.
        return [LoraFormat(COMFYUI_FILE, lambda: renamed(weights, lora_scale(metadata)))]

    # ---- using exported weights ----------------------------------------------------------------
    def denoiser_forward(self, denoiser: nn.Module, inputs) -> torch.Tensor:
        latents, timesteps, t5, llama, pooled = inputs
        # diffusers unpatchifies to images only outside training mode.
        training = denoiser.training
        denoiser.eval()
        try:
            return denoiser(hidden_states=latents, timesteps=timesteps, encoder_hidden_states_t5=t5,
                            encoder_hidden_states_llama3=llama, pooled_embeds=pooled,
                            return_dict=False)[0]
        finally:
            denoiser.train(training)

    # ---- benchmarks -------------------------------------------------------------------------
    bench_configs = SIZES
    plain_loop_unfit = ("HiDream's diffusers forward returns images only outside training mode, "
                        "where its MoE runs the routed experts without gradients: a plain loop "
                        "through it would not train them")

    def random_sample(self, size: str):
        shapes = SAMPLE_SHAPES[size]
        text = {key: torch.randn(shapes[key]) for key in ("t5", "llama", "pooled")}
        return torch.randn(shapes["latents"]), text

    def train_flops(self, denoiser: nn.Module, inputs: tuple, full: bool) -> float:
        latents, _t, t5 = inputs[:3]
        b, _, h, w = latents.shape
        p = denoiser.config.patch_size
        # diffusers pads a non-square image to `max_seq` tokens.
        image_tokens = (h // p) * (w // p) if h == w else denoiser.max_seq
        return b * costs.train_flops(self.pipeline_layers(denoiser), image_tokens, t5.shape[1],
                                     full)
