"""The tiny Chroma folder loads and runs through diffusers' real loading code; Chroma specifics."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest
import torch
from diffusers import ChromaPipeline

from dpipe.config.schema import ModelConfig
from dpipe.models.chroma.spec import ChromaSpec
from dpipe.models.spec import NoisedBatch
from tests.unit.video_checks import attention_masks_of_layers_and_diffusers, latent_inputs
from tests.exports import export_lora

CAPTION = "a red circle on a blue background"


@pytest.fixture(scope="module")
def pipe(tiny) -> ChromaPipeline:
    return ChromaPipeline.from_pretrained(tiny, dtype=torch.float32)


@pytest.fixture(scope="module")
def spec(tiny) -> ChromaSpec:
    return ChromaSpec(ModelConfig(family="chroma", path=str(tiny), max_text_tokens=32))


def test_prompt_mask_keeps_one_padding_token(spec, pipe):
    embeds = spec.encode_prompts(pipe, [CAPTION, "a star"])
    tokens = [len(pipe.tokenizer(p).input_ids) for p in (CAPTION, "a star")]  # with </s>
    assert embeds["mask"].sum(dim=1).tolist() == [n + 1 for n in tokens]


def _padded(text, inputs) -> tuple:
    """`inputs` with the text as cached: padded to max_text_tokens, the padding masked."""
    packed, t, _text, _mask, _txt_ids, img_ids = inputs
    image = torch.ones(packed.shape[:2], dtype=torch.long)
    mask = torch.cat([(text["mask"] > 0.5).long(), image], dim=1)
    txt_ids = torch.zeros(text["t5"].shape[1], 3, dtype=torch.long)
    return packed, t, text["t5"], mask, txt_ids, img_ids


def test_padding_tokens_do_not_reach_the_image(spec, pipe):
    """The transformer masks padding (as booleans): changing the masked text tokens' embeddings
    leaves the prediction unchanged, while changing an attended token changes it."""
    latents = torch.randn(1, 4, 16, 16)
    text = spec.encode_prompts(pipe, ["a star"])
    t = torch.tensor([0.5])
    batch = NoisedBatch(latents=latents, noise=latents, timesteps=t, noisy=latents,
                        target=latents, text=text)
    inputs = _padded(text, spec.make_inputs(batch)[0])
    denoiser = pipe.transformer
    with torch.no_grad():
        base = spec.denoiser_forward(denoiser, inputs)
        masked = text["mask"][0] == 0
        changed = inputs[2].clone()
        changed[0, masked] += 10.0
        same = spec.denoiser_forward(denoiser, (*inputs[:2], changed, *inputs[3:]))
        changed[0, 0] += 10.0
        different = spec.denoiser_forward(denoiser, (*inputs[:2], changed, *inputs[3:]))
    torch.testing.assert_close(same, base)
    assert (different - base).abs().max() > 1e-4


@pytest.mark.parametrize("prompts", [[CAPTION], [CAPTION, "a star"]])
def test_text_padding_is_cut_and_gives_diffusers_padded_output(spec, pipe, prompts, monkeypatch):
    """make_inputs cuts the text after the longest prompt and its one attended pad token: one
    prompt then leaves nothing to mask and no attention call gets a mask (SDPA can run flash);
    two of different lengths keep a mask. The layers give diffusers' output on the text as
    cached, padded to max_text_tokens and masked."""
    text = spec.encode_prompts(pipe, prompts)
    longest = int(text["mask"].sum(dim=1).max())
    assert longest < text["t5"].shape[1] == 32
    inputs = latent_inputs(spec, pipe, torch.randn(len(prompts), 4, 16, 16), prompts,
                           [0.3, 0.7][:len(prompts)])
    packed, _t, cut, mask, txt_ids, _img_ids = inputs
    assert cut.shape[1] == txt_ids.shape[0] == longest
    assert mask.shape[1] == (0 if len(prompts) == 1 else longest + packed.shape[1])
    x, expected, ours, theirs = attention_masks_of_layers_and_diffusers(
        monkeypatch, spec, spec.pipeline_layers(pipe.transformer), inputs, pipe.transformer,
        _padded(text, inputs))
    assert ours and all(m is not None for m in theirs)
    assert all(m is None for m in ours) == (len(prompts) == 1)
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)


def _inputs(spec, pipe):
    return latent_inputs(spec, pipe, torch.randn(2, 4, 16, 16), [CAPTION, "a star"], [0.2, 0.9])


def test_layers_reproduce_the_transformer(spec, pipe):
    inputs = _inputs(spec, pipe)
    with torch.no_grad():
        x = inputs
        for layer in spec.pipeline_layers(pipe.transformer):
            x = layer(x)
        expected = spec.denoiser_forward(pipe.transformer, inputs)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)


def test_mask_weights_follow_the_packing(spec):
    """A per-pixel weight map is packed like the latents: zeroing the top half of the map removes
    exactly the top half's latent error from the loss."""
    from types import SimpleNamespace

    latents = torch.randn(1, 4, 16, 16)
    text = {"t5": torch.zeros(1, 8, 32), "mask": torch.ones(1, 8)}
    weight = torch.ones(1, 1, 16, 16)
    weight[:, :, :8] = 0
    batch = SimpleNamespace(latents=latents, noisy=latents, target=latents, text=text,
                            timesteps=torch.tensor([0.5]), loss_weight=weight)
    inputs, labels = spec.make_inputs(batch)
    error = torch.randn(1, 4, 16, 16)
    from dpipe.models.common.latent_packing import pack

    out = labels[0] + pack(error)
    expected = error[:, :, 8:].square().sum() / error.numel()
    torch.testing.assert_close(spec.loss(out, labels), expected)


def test_comfyui_lora_folds_the_scale(spec, tmp_path):
    """The ComfyUI copy has diffusers' `transformer.` names (ComfyUI maps them for Flux-derived
    models, Chroma among them) and alpha / rank folded into lora_B, as ComfyUI reads no alpha."""
    from dataclasses import replace

    from safetensors.torch import load_file

    from dpipe.config.schema import LoraConfig

    spec = ChromaSpec(replace(spec.cfg, lora=LoraConfig(rank=2, alpha=6.0)))
    weights = {"transformer_blocks.0.attn.to_q.lora_A.default.weight": torch.randn(2, 32),
               "transformer_blocks.0.attn.to_q.lora_B.default.weight": torch.randn(32, 2)}
    files = export_lora(spec, weights, tmp_path)
    diffusers_file, comfy_file = (load_file(f) for f in files)
    assert diffusers_file.keys() == comfy_file.keys() == {
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight",
        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight"}
    a, b = "transformer.transformer_blocks.0.attn.to_q.lora_A.weight", \
        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight"
    torch.testing.assert_close(comfy_file[a], diffusers_file[a])
    torch.testing.assert_close(comfy_file[b], 3.0 * diffusers_file[b])


def test_block_costs_follow_flops(spec, pipe):
    """Double- and single-stream blocks do the same FLOPs per token: stages balance by blocks."""
    from dpipe.models.chroma.layers import ChromaDoubleBlock, ChromaSingleBlock
    from tests.unit.video_checks import assert_block_costs_follow_flops

    assert_block_costs_follow_flops(spec, spec.pipeline_layers(pipe.transformer),
                                    _inputs(spec, pipe), (ChromaDoubleBlock, ChromaSingleBlock))
