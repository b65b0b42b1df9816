"""The tiny AuraFlow folder loads and runs through diffusers' real loading code."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest
import torch
from diffusers import AuraFlowPipeline


CAPTION = "a red circle on a blue background"


@pytest.fixture(scope="module")
def pipe(tiny) -> AuraFlowPipeline:
    return AuraFlowPipeline.from_pretrained(tiny, dtype=torch.float32)


def test_scheduler_and_vae_as_the_release(pipe):
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
