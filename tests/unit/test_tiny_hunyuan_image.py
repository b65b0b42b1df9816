"""The tiny HunyuanImage 2.1: loads and generates with diffusers; its prompt template is cut where
the real one is; pipeline layers reproduce the transformer with glyph (ByT5) text in the batch;
trimming the Qwen padding changes nothing; the exported LoRA loads into the transformer."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest
import torch
from diffusers import HunyuanImagePipeline

from dpipe.config.schema import LoraConfig, ModelConfig
from dpipe.models.hunyuan_image.spec import HunyuanImageSpec
from dpipe.models.hunyuan_image.tiny import TEMPLATE, TEMPLATE_TOKENS
from dpipe.models.spec import NoisedBatch
from dpipe.train.lora import make_trainable
from tests.unit.video_checks import attention_masks_of_layers_and_diffusers
from tests.exports import export_lora

PROMPTS = ["a red circle on a blue background", 'a sign that says "hello" on a wall']


@pytest.fixture(scope="module")
def pipe(tiny) -> HunyuanImagePipeline:
    return HunyuanImagePipeline.from_pretrained(tiny, dtype=torch.float32)


def _spec(tiny, **kw) -> HunyuanImageSpec:
    return HunyuanImageSpec(ModelConfig(family="hunyuan_image", path=str(tiny),
                                        lora=LoraConfig(rank=4, alpha=4), max_text_tokens=32, **kw))


def test_template_prefix_is_cut_where_the_real_one_is(pipe):
    ids = pipe.tokenizer(TEMPLATE.format("a red circle")).input_ids
    assert pipe.prompt_template_encode_start_idx == TEMPLATE_TOKENS
    # The user's prompt starts right after the cut: the template's words are single tokens.
    tokens = pipe.tokenizer.convert_ids_to_tokens(ids)
    assert tokens[TEMPLATE_TOKENS - 3:TEMPLATE_TOKENS + 1] == ["<|im_start|>", "user", "Ċ", "a"]


def _batch(spec, encoders, gen):
    text = spec.encode_prompts(encoders, PROMPTS)
    x0 = torch.randn(2, 16, 16, 16, generator=gen)
    noise = torch.randn(x0.shape, generator=gen)
    t = torch.tensor([0.2, 0.7])
    noisy, target = spec.noise(x0, noise, t)
    return text, NoisedBatch(x0, noise, t, noisy, target, text)


def test_layers_reproduce_the_transformer_with_glyph_text(tiny, pipe):
    spec = _spec(tiny)
    text, batch = _batch(spec, pipe, torch.Generator().manual_seed(0))
    assert text["glyph_mask"][0].sum() == 0 and text["glyph_mask"][1].sum() > 0  # quoted "hello"
    inputs, labels = spec.make_inputs(batch)
    transformer = spec.load_denoiser(torch.float32)
    make_trainable(transformer, spec.cfg, spec.lora_targets())
    for name, p in transformer.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    x = inputs
    for layer in spec.pipeline_layers(transformer):
        x = layer(x)
        # DeepSpeed sends stage outputs as they are: they must be contiguous.
        assert all(t.is_contiguous() for t in (x if isinstance(x, tuple) else (x,)))
    with torch.no_grad():
        expected = spec.denoiser_forward(transformer, inputs)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)
    spec.loss(x, labels).backward()
    assert all(p.grad is not None for n, p in transformer.named_parameters() if "lora_" in n)


def test_dropping_qwen_padding_changes_nothing(tiny, pipe):
    spec = _spec(tiny)
    text, batch = _batch(spec, pipe, torch.Generator().manual_seed(1))
    full, mask, glyph, glyph_mask = pipe.encode_prompt(PROMPTS, batch_size=2)
    assert full.shape[1] == 1000 and torch.equal(full[:, :32], text["text"])
    inputs, _ = spec.make_inputs(batch)
    long_inputs = (inputs[0], inputs[1], full, mask.long(), glyph, glyph_mask.long(), *inputs[6:])
    transformer = spec.load_denoiser(torch.float32)
    with torch.no_grad():
        short = spec.denoiser_forward(transformer, inputs)
        long = spec.denoiser_forward(transformer, long_inputs)
    torch.testing.assert_close(short, long, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS[1:], PROMPTS])
def test_text_padding_is_cut_and_gives_diffusers_padded_output(tiny, pipe, prompts, monkeypatch):
    """make_inputs cuts both text streams after their longest prompt (and drops the glyph stream
    of a batch without quoted text): one prompt, with or without glyph text, then leaves nothing
    to mask and no attention call gets a mask (SDPA can run flash); two prompts keep one. The
    layers give diffusers' output on the text as cached, padded and masked."""
    spec = _spec(tiny)
    text = spec.encode_prompts(pipe, prompts)
    gen = torch.Generator().manual_seed(2)
    x0 = torch.randn(len(prompts), 16, 16, 16, generator=gen)
    t = torch.tensor([0.2, 0.7][:len(prompts)])
    noisy, target = spec.noise(x0, x0, t)
    inputs, _ = spec.make_inputs(NoisedBatch(x0, x0, t, noisy, target, text))
    _, _, qwen, qwen_mask, glyph, glyph_mask, _, joint_mask = inputs
    real, real_glyph = text["text_mask"].sum(1), text["glyph_mask"].sum(1)
    assert qwen.shape[1] == int(real.max()) < text["text"].shape[1]
    assert glyph.shape[1] == int(real_glyph.max()) < text["glyph"].shape[1]
    one = len(prompts) == 1
    assert qwen_mask.shape[1] == glyph_mask.shape[1] == joint_mask.shape[1] == 0 or not one
    assert joint_mask.shape[1] == (0 if one else int((real + real_glyph).max()))
    cached = (*inputs[:2], text["text"], text["text_mask"].long(), text["glyph"],
              text["glyph_mask"].long(), *inputs[6:])
    transformer = spec.load_denoiser(torch.float32)
    x, expected, ours, theirs = attention_masks_of_layers_and_diffusers(
        monkeypatch, spec, spec.pipeline_layers(transformer), inputs, transformer, cached)
    assert ours and all(m is not None for m in theirs)  # diffusers always masks
    assert all(m is None for m in ours) == one
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)


def test_exported_lora_loads_into_the_transformer(tiny, tmp_path):
    spec = _spec(tiny)
    transformer = spec.load_denoiser(torch.float32)
    make_trainable(transformer, spec.cfg, spec.lora_targets())
    gen = torch.Generator().manual_seed(2)
    for name, p in transformer.named_parameters():
        if "lora_" in name:
            p.data = torch.randn(p.shape, generator=gen) * 0.05
    lora = {n: p.detach() for n, p in transformer.named_parameters() if "lora_" in n}
    export_lora(spec, lora, tmp_path)
    loaded = spec.load_denoiser_with_lora(tmp_path)
    inputs = (torch.randn(1, 16, 8, 8), torch.tensor([400.0]), torch.randn(1, 32, 32),
              torch.ones(1, 32, dtype=torch.long), torch.zeros(1, 128, 24),
              torch.zeros(1, 128, dtype=torch.long), torch.tensor([3500.0]),
              torch.zeros(1, 0, dtype=torch.long))
    with torch.no_grad():
        torch.testing.assert_close(spec.denoiser_forward(loaded, inputs),
                                   spec.denoiser_forward(transformer, inputs))


def test_block_costs_follow_flops(tiny, pipe):
    """Dual- and single-stream blocks do the same FLOPs per token: stages balance by blocks."""
    from dpipe.models.hunyuan_image.layers import HunyuanImageBlock
    from tests.unit.video_checks import assert_block_costs_follow_flops

    spec = _spec(tiny)
    _text, batch = _batch(spec, pipe, torch.Generator().manual_seed(0))
    inputs, _ = spec.make_inputs(batch)
    layers = spec.pipeline_layers(spec.load_denoiser(torch.float32))
    assert_block_costs_follow_flops(spec, layers, inputs, HunyuanImageBlock)
