"""The tiny AuraFlow folder loads and runs through diffusers' real loading code."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
from pathlib import Path

import pytest
import torch
from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel
from transformers import LlamaTokenizerFast, UMT5EncoderModel

from dpipe.models.auraflow.tiny import make_tiny_auraflow

CAPTION = "a red circle on a blue background"


@pytest.fixture(scope="module")
def tiny(tiny_models) -> Path:
    return make_tiny_auraflow(tiny_models / "tiny-auraflow")


@pytest.fixture(scope="module")
def pipe(tiny) -> AuraFlowPipeline:
    return AuraFlowPipeline.from_pretrained(tiny, dtype=torch.float32)


def test_layout_and_components(tiny, pipe):
    index = json.loads((tiny / "model_index.json").read_text())
    assert index["_class_name"] == "AuraFlowPipeline"
    assert index["tokenizer"] == ["transformers", "LlamaTokenizerFast"]
    assert index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
    assert isinstance(pipe.text_encoder, UMT5EncoderModel)
    assert isinstance(pipe.tokenizer, LlamaTokenizerFast)
    assert isinstance(pipe.transformer, AuraFlowTransformer2DModel)
    assert len(list((tiny / "transformer").glob("*-of-00002.safetensors"))) == 2
    assert pipe.scheduler.config.shift == pytest.approx(1.73)
    assert pipe.vae.config.scaling_factor == pytest.approx(0.13025)


def test_prompt_tokens(pipe):
    ids = pipe.tokenizer(CAPTION).input_ids
    # One piece per word, then </s>; no <unk>, no bos (Pile-T5's convention).
    assert len(ids) == len(CAPTION.split()) + 1 and ids[-1] == 2
    assert pipe.tokenizer.unk_token_id not in ids
    embeds, mask, _, _ = pipe.encode_prompt(CAPTION, do_classifier_free_guidance=False,
                                            max_sequence_length=32)
    assert embeds.shape == (1, 32, 32)
    assert (embeds[0, len(ids):] == 0).all()  # the pipeline zeroes the padding's embeddings
    assert int(mask.sum()) == len(ids) * 32  # its mask comes back expanded over the width


def test_deterministic(tmp_path, tiny):
    again = make_tiny_auraflow(tmp_path / "again", seed=0)
    for rel in ["transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
                "text_encoder/model.safetensors", "tokenizer/tokenizer.json"]:
        assert (tiny / rel).read_bytes() == (again / rel).read_bytes(), rel


def test_layers_reproduce_the_transformer(tiny):
    from dpipe.config.schema import LoraConfig, ModelConfig
    from dpipe.models.auraflow.spec import AuraFlowSpec
    from dpipe.train.lora import make_trainable

    spec = AuraFlowSpec(ModelConfig(family="auraflow", path=str(tiny), lora=LoraConfig(rank=4)))
    transformer = spec.load_denoiser(torch.float32)
    make_trainable(transformer, spec.cfg, spec.lora_targets())
    for name, p in transformer.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    gen = torch.Generator().manual_seed(0)
    inputs = (torch.randn(2, 4, 16, 8, generator=gen), torch.tensor([0.3, 0.9]),
              torch.randn(2, 32, 32, generator=gen))  # a non-square latent
    x = inputs
    for layer in spec.pipeline_layers(transformer):
        x = layer(x)
        # DeepSpeed sends stage outputs as they are: they must be contiguous.
        assert all(t.is_contiguous() for t in (x if isinstance(x, tuple) else (x,)))
    with torch.no_grad():
        expected = spec.denoiser_forward(transformer, inputs)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)
    x.square().mean().backward()
    assert all(p.grad is not None for n, p in transformer.named_parameters() if "lora_" in n)


def test_block_costs_follow_flops(tiny):
    """Joint (two-stream) and single blocks do the same FLOPs per token: stages balance by
    blocks, not by parameters."""
    from dpipe.config.schema import ModelConfig
    from dpipe.models.auraflow.layers import AuraFlowJointBlock, AuraFlowSingleBlock
    from dpipe.models.auraflow.spec import AuraFlowSpec
    from tests.unit.video_checks import assert_block_costs_follow_flops

    spec = AuraFlowSpec(ModelConfig(family="auraflow", path=str(tiny)))
    gen = torch.Generator().manual_seed(0)
    inputs = (torch.randn(2, 4, 16, 16, generator=gen), torch.tensor([0.3, 0.9]),
              torch.randn(2, 32, 32, generator=gen))
    assert_block_costs_follow_flops(spec, spec.pipeline_layers(spec.load_denoiser(torch.float32)),
                                    inputs, (AuraFlowJointBlock, AuraFlowSingleBlock))
