"""The tiny SD3.5 folder loads and runs through diffusers' real loading code; SD3 specifics."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import re

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from dpipe.models.sd3.spec import LORA_TARGETS

CAPTION = "a red circle on a blue background"


@pytest.fixture(scope="module")
def pipe(tiny) -> StableDiffusion3Pipeline:
    return StableDiffusion3Pipeline.from_pretrained(tiny, dtype=torch.float32)


def test_sd3_conventions(pipe):
    # CLIP-G's tokenizer pads with "!", CLIP-L's with <|endoftext|>, as in the real repo.
    assert pipe.tokenizer_2.pad_token == "!" and pipe.tokenizer.pad_token == "<|endoftext|>"
    assert pipe.scheduler.config.shift == 3.0 and not pipe.scheduler.config.use_dynamic_shifting
    assert (pipe.vae.config.latent_channels, pipe.vae.config.shift_factor,
            pipe.vae.config.scaling_factor) == (4, 0.0609, 1.5305)
    embeds, _, pooled, _ = pipe.encode_prompt(CAPTION, None, None,
                                              do_classifier_free_guidance=False,
                                              max_sequence_length=32)
    assert embeds.shape == (1, 77 + 32, 64) and pooled.shape == (1, 64)


def test_blocks_are_sd35_mediums(pipe):
    """SD3.5-medium's second attention, and its last block context_pre_only (that every Linear of
    the blocks takes LoRA: test_family_checks)."""
    names = {name for name, _ in pipe.transformer.named_modules()}
    assert {"transformer_blocks.0.attn2.to_q", "transformer_blocks.2.norm1_context.linear"} <= names
    assert not any(name.startswith("transformer_blocks.2.ff_context") for name in names)


def test_mask_weights_scale_the_loss(tiny):
    from types import SimpleNamespace

    from dpipe.config.schema import ModelConfig
    from dpipe.models.sd3.spec import SD3Spec

    spec = SD3Spec(ModelConfig(family="sd3", path=str(tiny)))
    latents, out = torch.randn(2, 4, 16, 16), torch.randn(2, 4, 16, 16)
    text = {"text": torch.zeros(2, 8, 64), "pooled": torch.zeros(2, 64)}
    batch = SimpleNamespace(latents=latents, noisy=latents, target=latents, text=text,
                            timesteps=torch.tensor([0.1, 0.9]), loss_weight=None)
    plain = spec.loss(out, spec.make_inputs(batch)[1])
    batch.loss_weight = torch.ones(2, 1, 16, 16)
    torch.testing.assert_close(spec.loss(out, spec.make_inputs(batch)[1]), plain)
    batch.loss_weight[:, :, :8] = 0  # the top half of every image does not count
    half = ((out - latents)[:, :, 8:].square().sum() / out.numel())
    torch.testing.assert_close(spec.loss(out, spec.make_inputs(batch)[1]), half)


def _to_original(sd: dict, num_layers: int) -> dict:
    """diffusers SD3 transformer weights -> the original MMDiT layout (the inverse of diffusers'
    `convert_sd3_transformer_checkpoint_to_diffusers`), so the ComfyUI LoRA can be merged there."""
    def swap(w):
        a, b = w.chunk(2, dim=0)
        return torch.cat([b, a], dim=0)

    o = {"pos_embed": sd["pos_embed.pos_embed"],
         "x_embedder.proj.weight": sd["pos_embed.proj.weight"],
         "x_embedder.proj.bias": sd["pos_embed.proj.bias"],
         "context_embedder.weight": sd["context_embedder.weight"],
         "context_embedder.bias": sd["context_embedder.bias"],
         "final_layer.linear.weight": sd["proj_out.weight"],
         "final_layer.linear.bias": sd["proj_out.bias"],
         "final_layer.adaLN_modulation.1.weight": swap(sd["norm_out.linear.weight"]),
         "final_layer.adaLN_modulation.1.bias": swap(sd["norm_out.linear.bias"])}
    for ours, theirs in (("timestep_embedder", "t_embedder"), ("text_embedder", "y_embedder")):
        for n, m in (("linear_1", "0"), ("linear_2", "2")):
            for p in ("weight", "bias"):
                o[f"{theirs}.mlp.{m}.{p}"] = sd[f"time_text_embed.{ours}.{n}.{p}"]
    for i in range(num_layers):
        d, j = f"transformer_blocks.{i}.", f"joint_blocks.{i}."
        for p in ("weight", "bias"):
            o[f"{j}x_block.attn.qkv.{p}"] = torch.cat(
                [sd[f"{d}attn.to_{x}.{p}"] for x in "qkv"])
            o[f"{j}context_block.attn.qkv.{p}"] = torch.cat(
                [sd[f"{d}attn.add_{x}_proj.{p}"] for x in "qkv"])
            if f"{d}attn2.to_q.{p}" in sd:
                o[f"{j}x_block.attn2.qkv.{p}"] = torch.cat(
                    [sd[f"{d}attn2.to_{x}.{p}"] for x in "qkv"])
            for ours, theirs in _PLAIN.items():
                if f"{d}{ours}.{p}" in sd:
                    value = sd[f"{d}{ours}.{p}"]
                    if ours == "norm1_context.linear" and i == num_layers - 1:
                        value = swap(value)
                    o[f"{j}{theirs}.{p}"] = value
        for ours, theirs in (("attn.norm_q", "x_block.attn.ln_q"), ("attn.norm_k", "x_block.attn.ln_k"),
                             ("attn.norm_added_q", "context_block.attn.ln_q"),
                             ("attn.norm_added_k", "context_block.attn.ln_k"),
                             ("attn2.norm_q", "x_block.attn2.ln_q"),
                             ("attn2.norm_k", "x_block.attn2.ln_k")):
            if f"{d}{ours}.weight" in sd:
                o[f"{j}{theirs}.weight"] = sd[f"{d}{ours}.weight"]
    return o


_PLAIN = {"attn.to_out.0": "x_block.attn.proj", "attn.to_add_out": "context_block.attn.proj",
          "attn2.to_out.0": "x_block.attn2.proj", "norm1.linear": "x_block.adaLN_modulation.1",
          "norm1_context.linear": "context_block.adaLN_modulation.1",
          "ff.net.0.proj": "x_block.mlp.fc1", "ff.net.2": "x_block.mlp.fc2",
          "ff_context.net.0.proj": "context_block.mlp.fc1",
          "ff_context.net.2": "context_block.mlp.fc2"}


def test_comfyui_lora_equals_the_diffusers_lora(pipe):
    """The ComfyUI file, merged into the original-layout weights and converted back by diffusers'
    own single-file code, gives the weights the diffusers LoRA gives (also through fused q/k/v,
    SD3.5's attn2 and the last block's swapped modulation)."""
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    from dpipe.models.sd3.comfyui import comfyui_lora

    transformer = pipe.transformer
    sd = {k: v.detach().clone() for k, v in transformer.state_dict().items()}
    layers = transformer.config.num_layers
    original = _to_original(sd, layers)
    back = convert_sd3_transformer_checkpoint_to_diffusers(dict(original))
    assert back.keys() == sd.keys()
    for key in sd:
        torch.testing.assert_close(back[key], sd[key], rtol=0, atol=0, msg=key)

    torch.manual_seed(0)
    rank, scale = 2, 3.0  # alpha / rank
    # Every Linear, the default targets and the embedders' and final layer's (swapped) alike.
    targets = [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    assert any(re.fullmatch(LORA_TARGETS, n) for n in targets) and "norm_out.linear" in targets
    lora = {}
    for name in targets:
        linear = transformer.get_submodule(name)
        lora[f"{name}.lora_A.weight"] = torch.randn(rank, linear.in_features)
        lora[f"{name}.lora_B.weight"] = torch.randn(linear.out_features, rank)
    comfy = comfyui_lora(lora, scale, layers)
    assert all(k.startswith("diffusion_model.") for k in comfy)
    merged_original = dict(original)
    for key in comfy:
        if key.endswith(".lora_A.weight"):
            module = key[len("diffusion_model."):-len(".lora_A.weight")]
            up = comfy[key.replace(".lora_A.", ".lora_B.")]
            merged_original[f"{module}.weight"] = original[f"{module}.weight"] + up @ comfy[key]
    merged = convert_sd3_transformer_checkpoint_to_diffusers(merged_original)
    for name in targets:
        expected = sd[f"{name}.weight"] + scale * (
            lora[f"{name}.lora_B.weight"] @ lora[f"{name}.lora_A.weight"])
        torch.testing.assert_close(merged[f"{name}.weight"], expected, msg=name)
