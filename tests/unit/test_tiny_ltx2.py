"""The tiny LTX-2 folder loads through diffusers' real loading code and generates video + audio;
dpipe's video-only layers, encoders and LoRA exports match what diffusers does."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from dpipe.config.schema import ModelConfig
from dpipe.errors import DataError
from dpipe.models.comfyui import peft_pairs
from dpipe.models.ltx_video.ltx2.spec import COMFYUI_LORA, LTX2Spec
from dpipe.models.lora_files import DIFFUSERS_LORA
from dpipe.models.sync_free import sizes
from tests.unit.video_checks import (
    CAPTIONS, assert_checkpointing_matches, assert_layers_match, deltas, lora_denoiser,
    lora_state_dict, micro_batch)
from tests.exports import export_lora


def make_spec(tiny, **values):
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "family": "ltx2", "path": str(tiny), "max_text_tokens": 16,
        "lora": {"rank": 4, "alpha": 8}, **values}))
    spec = LTX2Spec(cfg)
    spec.ensure_available()
    return spec


@pytest.fixture(scope="module")
def spec(tiny) -> LTX2Spec:
    return make_spec(tiny)


@pytest.fixture(scope="module")
def encoders(spec):
    return spec.load_encoders(torch.device("cpu"), torch.float32)


def test_parts_as_the_real_repo(tiny):
    for part in ("connectors", "audio_vae", "vocoder", "vae", "scheduler", "tokenizer"):
        assert (tiny / part).is_dir(), part


def test_encoders(spec, encoders):
    assert spec.encode_images(encoders, torch.zeros(2, 3, 64, 64)).shape == (2, 8, 1, 8, 8)
    # A clip's 2 latent frames, then its last frame's own (keyframes.py)
    assert spec.encode_videos(encoders, torch.zeros(1, 3, 9, 64, 64)).shape == (1, 8, 3, 8, 8)
    with pytest.raises(DataError, match="8k\\+1"):
        spec.encode_videos(encoders, torch.zeros(1, 3, 5, 64, 64))
    text = spec.encode_prompts(encoders, CAPTIONS)
    # The connectors' video prompt tokens, as LTX2Pipeline hands them to the transformer.
    embeds, mask, _, _ = encoders.encode_prompt(CAPTIONS, do_classifier_free_guidance=False,
                                                max_sequence_length=16)
    video, _, mask = encoders.connectors(embeds, mask, padding_side="left")
    torch.testing.assert_close(text["video_text"], video)


@pytest.mark.parametrize("frames", [1, 9, 17])
def test_layers_match_diffusers_video_stream(spec, encoders, frames):
    inputs, _ = micro_batch(spec, encoders, torch.rand(2, 3, frames, 64, 64) * 2 - 1)
    assert_layers_match(spec, lora_denoiser(spec), inputs)


def test_isolated_video_stream_ignores_the_audio(spec, encoders):
    denoiser = spec.load_denoiser(torch.float32)
    packed, t, text, mask, grid, _rate = micro_batch(spec, encoders, torch.rand(1, 3, 9, 64, 64))[0]
    f, h, w = sizes(grid)
    outs = []
    with torch.no_grad():
        for audio_tokens in (1, 5):
            audio = torch.randn(1, audio_tokens, denoiser.config.audio_in_channels)
            outs.append(denoiser(
                hidden_states=packed, audio_hidden_states=audio, encoder_hidden_states=text,
                audio_encoder_hidden_states=torch.randn_like(text), timestep=t.flatten() * 1000,
                sigma=t.flatten() * 1000, encoder_attention_mask=mask,
                audio_encoder_attention_mask=mask, num_frames=f, height=h, width=w, fps=24.0,
                audio_num_frames=audio_tokens, isolate_modalities=True, return_dict=False)[0])
    torch.testing.assert_close(outs[0], outs[1])


def test_activation_checkpointing_gives_the_same_gradients(spec, encoders):
    inputs, labels = micro_batch(spec, encoders, torch.rand(2, 3, 9, 64, 64) * 2 - 1)
    assert_checkpointing_matches(spec, lora_denoiser(spec), inputs, labels)


def test_lora_targets_are_video_only(spec):
    names = [n for n, p in lora_denoiser(spec).named_parameters() if "lora_A" in n]
    assert names and not any("audio" in n or "video_to_audio" in n for n in names)
    assert {n.split(".")[2] for n in names} == {"attn1", "attn2", "ff"}


@pytest.fixture(scope="module")
def exported(spec, tmp_path_factory):
    denoiser = lora_denoiser(spec)
    out = tmp_path_factory.mktemp("lora")
    assert export_lora(spec, lora_state_dict(denoiser), out) == [out / DIFFUSERS_LORA,
                                                                 out / COMFYUI_LORA]
    return denoiser, out


@pytest.mark.parametrize("weight_name", [DIFFUSERS_LORA, COMFYUI_LORA])
def test_both_lora_files_load_with_the_pipeline(spec, encoders, exported, weight_name):
    denoiser, out = exported
    inputs, _ = micro_batch(spec, encoders, torch.rand(2, 3, 9, 64, 64) * 2 - 1)
    with torch.no_grad():
        expected = spec.denoiser_forward(denoiser, inputs)
        loaded = spec.denoiser_forward(spec.load_denoiser_with_lora(out, weight_name), inputs)
    torch.testing.assert_close(loaded, expected, rtol=1e-4, atol=1e-5)


def test_comfyui_keys(exported):
    denoiser, out = exported
    comfy = load_file(out / COMFYUI_LORA)
    assert "diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight" in comfy
    got = deltas({k.removeprefix("diffusion_model."): v for k, v in peft_pairs(comfy).items()})
    want = deltas(peft_pairs(lora_state_dict(denoiser)), scale=8 / 4)
    assert got.keys() == want.keys()


def test_each_clip_trains_at_its_frame_rate(spec, encoders):
    """LTX-2 divides the temporal positions by the clip's rate: each sample of a mixed batch
    gets what the transformer's own forward gives that clip alone at its fps (an image, NaN,
    LTX2Pipeline's default 24)."""
    from tests.unit.test_tiny_ltx_video import _batch_at
    from tests.unit.video_checks import run

    assert sizes(micro_batch(spec, encoders, torch.rand(2, 3, 9, 64, 64))[0][5]) == (24000,) * 2
    inputs, _ = spec.make_inputs(_batch_at(spec, encoders, [30.0, float("nan")]))
    assert sizes(inputs[5]) == (30000, 24000)
    denoiser = lora_denoiser(spec)
    mixed = assert_layers_match(spec, denoiser, inputs)
    cfg = denoiser.config
    f, h, w = sizes(inputs[4])
    with torch.no_grad():
        for i, fps in enumerate([30.0, 24.0]):
            packed, t, text, mask = (x[i:i + 1] for x in inputs[:4])
            alone = denoiser(
                hidden_states=packed, audio_hidden_states=packed.new_zeros(
                    1, 1, cfg.audio_in_channels), encoder_hidden_states=text,
                audio_encoder_hidden_states=text.new_zeros(1, text.shape[1], cfg.caption_channels),
                timestep=t.flatten() * 1000, sigma=t.flatten() * 1000,
                encoder_attention_mask=mask, audio_encoder_attention_mask=mask, num_frames=f,
                height=h, width=w, fps=fps, audio_num_frames=1, isolate_modalities=True,
                return_dict=False)[0]
            torch.testing.assert_close(mixed[i:i + 1], alone, rtol=1e-5, atol=1e-5)
        at_24 = run(spec.pipeline_layers(denoiser),
                    spec.make_inputs(_batch_at(spec, encoders, [24.0, 24.0]))[0])
    assert (at_24[0] - mixed[0]).abs().max() > 1e-5  # the rate moves the temporal positions
