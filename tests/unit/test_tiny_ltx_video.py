"""The tiny LTX-Video folder loads through diffusers' real loading code (text-to-video and
image-to-video pipelines); layers, encoders, first-frame conditioning and LoRA exports."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


import numpy as np
import pytest
import torch
from diffusers import LTXImageToVideoPipeline, LTXPipeline
from omegaconf import OmegaConf
from PIL import Image
from safetensors.torch import load_file

from dpipe.config.schema import ModelConfig
from dpipe.errors import DataError
from dpipe.models.comfyui import peft_pairs
from dpipe.models.lora_files import DIFFUSERS_LORA
from dpipe.models.ltx_video.spec import COMFYUI_LORA, LTXVideoSpec
from dpipe.models.spec import NoisedBatch
from dpipe.models.sync_free import carrier, sizes
from tests.unit.video_checks import (
    CAPTIONS, assert_checkpointing_matches, assert_layers_match, deltas, lora_denoiser,
    attention_masks_of_layers_and_diffusers, lora_state_dict, micro_batch)
from tests.exports import export_lora


def make_spec(tiny, **values) -> LTXVideoSpec:
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "family": "ltx_video", "path": str(tiny), "max_text_tokens": 16,
        "lora": {"rank": 4, "alpha": 8}, **values}))
    spec = LTXVideoSpec(cfg)
    spec.ensure_available()
    return spec


@pytest.fixture(scope="module")
def spec(tiny) -> LTXVideoSpec:
    return make_spec(tiny)


@pytest.fixture(scope="module")
def i2v_spec(tiny) -> LTXVideoSpec:
    return make_spec(tiny, i2v=True)


@pytest.fixture(scope="module")
def encoders(spec):
    return spec.load_encoders(torch.device("cpu"), torch.float32)


def test_generates_image_to_video(tiny):
    # text to video: test_family_checks' test_loads_in_its_pipeline_and_generates
    i2v = LTXImageToVideoPipeline.from_pretrained(tiny, dtype=torch.float32)
    out = i2v(image=Image.new("RGB", (64, 64), (200, 20, 20)), prompt=CAPTIONS[0], height=64,
              width=64, num_frames=9, num_inference_steps=2, max_sequence_length=16,
              generator=torch.Generator().manual_seed(0), output_type="np")
    assert out.frames.shape == (1, 9, 64, 64, 3) and np.isfinite(out.frames).all()


def test_vae_holds_the_latent_statistics(tiny):
    assert "latents_mean" in load_file(tiny / "vae/diffusion_pytorch_model.safetensors")


def test_encode_normalises_as_the_pipeline(spec, encoders):
    pixels = torch.rand(1, 3, 9, 64, 64) * 2 - 1
    latents = spec.encode_videos(encoders, pixels)
    assert latents.shape == (1, 8, 2, 8, 8)  # 8k+1 frames -> k+1 latent frames
    raw = encoders.vae.encode(pixels).latent_dist.mode()
    want = LTXPipeline._normalize_latents(raw, encoders.vae.latents_mean, encoders.vae.latents_std,
                                          encoders.vae.config.scaling_factor)
    torch.testing.assert_close(latents, want)
    assert spec.encode_images(encoders, torch.zeros(2, 3, 64, 64)).shape == (2, 8, 1, 8, 8)
    with pytest.raises(DataError, match="8k\\+1"):
        spec.encode_videos(encoders, torch.zeros(1, 3, 5, 64, 64))
    text = spec.encode_prompts(encoders, CAPTIONS)
    assert text["t5"].shape == (2, 16, 32) and text["mask"].dtype == torch.long


@pytest.mark.parametrize("frames", [1, 9, 17])
@pytest.mark.parametrize("i2v", [False, True])
def test_layers_match_diffusers_on_video_latents(tiny, encoders, frames, i2v):
    spec = make_spec(tiny, i2v=i2v)
    inputs, _ = micro_batch(spec, encoders, torch.rand(2, 3, frames, 64, 64) * 2 - 1)
    assert inputs[0].shape == (2, ((frames - 1) // 8 + 1) * 64, 8)
    assert inputs[1].shape[1] == (inputs[0].shape[1] if i2v and frames > 1 else 1)
    assert_layers_match(spec, lora_denoiser(spec), inputs)


@pytest.mark.parametrize("clips", [1, 2])
def test_text_padding_is_cut_and_gives_diffusers_padded_output(spec, encoders, clips,
                                                               monkeypatch):
    """make_inputs cuts the text after the longest prompt: one clip then leaves no padding and no
    attention call gets a mask (SDPA can run flash); two prompts of different lengths keep one.
    The layers give diffusers' output on the text padded as cached."""
    inputs, _ = micro_batch(spec, encoders, torch.rand(clips, 3, 9, 64, 64) * 2 - 1)
    text = spec.encode_prompts(encoders, CAPTIONS[:clips])
    longest = int(text["mask"].sum(1).max())
    assert text["t5"].shape[1] == 16 and longest < 16 and inputs[2].shape[1] == longest
    assert inputs[3].shape[1] == (0 if clips == 1 else longest)
    padded = (*inputs[:2], text["t5"].float(), text["mask"], *inputs[4:])
    denoiser = lora_denoiser(spec)
    got, expected, ours, theirs = attention_masks_of_layers_and_diffusers(
        monkeypatch, spec, spec.pipeline_layers(denoiser), inputs, denoiser, padded)
    assert ours and any(m is not None for m in theirs)  # diffusers' cross-attention
    assert all(m is None for m in ours) == (clips == 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_first_frame_conditioning_as_the_i2v_pipeline(i2v_spec, encoders):
    pixels = torch.rand(2, 3, 17, 64, 64) * 2 - 1
    (packed, t_tokens, *_), labels = micro_batch(i2v_spec, encoders, pixels, t=(0.3, 0.8))
    latents = i2v_spec.encode_videos(encoders, pixels)
    # The pipeline's conditioning mask: 1 on the first latent frame, packed to tokens.
    mask = torch.zeros(2, 1, 3, 8, 8)
    mask[:, :, 0] = 1.0
    mask = LTXImageToVideoPipeline._pack_latents(mask, 1, 1).squeeze(-1)
    torch.testing.assert_close(t_tokens, torch.tensor([[0.3], [0.8]]) * (1 - mask))
    # The condition tokens carry the clean first frame; the others are noised.
    clean = LTXImageToVideoPipeline._pack_latents(latents, 1, 1)
    torch.testing.assert_close(packed[:, :64], clean[:, :64])
    assert (packed[:, 64:] - clean[:, 64:]).abs().mean() > 0.1
    # The loss ignores the condition tokens and averages over the others.
    target = labels[0]
    out = target.clone()
    out[:, :64] += 5.0
    assert i2v_spec.loss(out, labels).item() == 0.0
    out[:, 64:] += 1.0
    assert i2v_spec.loss(out, labels).item() == pytest.approx(1.0)
    # Images (one latent frame) have nothing to condition on: they train text-to-image.
    (_, t_image, *_), image_labels = micro_batch(i2v_spec, encoders, torch.zeros(2, 3, 1, 64, 64))
    assert t_image.shape == (2, 1) and len(image_labels) == 1


def test_activation_checkpointing_gives_the_same_gradients(i2v_spec, encoders):
    inputs, labels = micro_batch(i2v_spec, encoders, torch.rand(2, 3, 9, 64, 64) * 2 - 1)
    assert_checkpointing_matches(i2v_spec, lora_denoiser(i2v_spec), inputs, labels)


@pytest.fixture(scope="module")
def exported(spec, tmp_path_factory):
    denoiser = lora_denoiser(spec)
    out = tmp_path_factory.mktemp("lora")
    assert export_lora(spec, lora_state_dict(denoiser), out) == [out / DIFFUSERS_LORA,
                                                                 out / COMFYUI_LORA]
    return denoiser, out


@pytest.mark.parametrize("weight_name", [DIFFUSERS_LORA, COMFYUI_LORA])
def test_both_lora_files_load_with_the_pipeline(spec, encoders, exported, weight_name):
    # diffusers reads ComfyUI's `diffusion_model.` layout for LTX-Video as ComfyUI does: the
    # same module names under another prefix.
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
    assert "diffusion_model.transformer_blocks.1.ff.net.2.lora_B.weight" in comfy
    assert not any(k.endswith(".alpha") for k in comfy)
    got = deltas({k.removeprefix("diffusion_model."): v for k, v in peft_pairs(comfy).items()})
    want = deltas(peft_pairs(lora_state_dict(denoiser)), scale=8 / 4)
    assert got.keys() == want.keys() and len(want) == 4 * 10
    for name in want:
        torch.testing.assert_close(got[name], want[name])


def _batch_at(spec, encoders, fps, frames=9, seed=0):
    """A NoisedBatch of len(fps) clips with those frame rates (NaN: an image's, the default)."""
    from dpipe.models.spec import NoisedBatch

    g = torch.Generator().manual_seed(seed)
    pixels = torch.rand(len(fps), 3, frames, 64, 64, generator=g) * 2 - 1
    latents = spec.encode_videos(encoders, pixels).float()  # as cached
    text = {k: v.float() for k, v in spec.encode_prompts(encoders, CAPTIONS[:len(fps)]).items()}
    noise = torch.randn(latents.shape, generator=g)
    t = torch.tensor([0.3, 0.8][:len(fps)])
    noisy, target = spec.noise(latents, noise, t)
    return NoisedBatch(latents, noise, t, noisy, target, text, fps=torch.tensor(fps))


def test_each_clip_trains_at_its_frame_rate(spec, encoders, tiny):
    from diffusers import AutoencoderKLLTXVideo

    from dpipe.models.ltx_video.layers import rope_scale
    from tests.unit.video_checks import run

    # Without a dataset's rates: LTXPipeline's default, 25 fps.
    assert sizes(micro_batch(spec, encoders, torch.rand(2, 3, 9, 64, 64))[0][5]) == (25000,) * 2
    batch = _batch_at(spec, encoders, [24.0, float("nan")])
    inputs, _ = spec.make_inputs(batch)
    assert sizes(inputs[5]) == (24000, 25000)  # the image (NaN) at the default
    # One rate for the batch: LTXPipeline's rope_interpolation_scale at frame_rate=30.
    vae = AutoencoderKLLTXVideo.from_pretrained(tiny / "vae")
    s, tc = vae.spatial_compression_ratio, vae.temporal_compression_ratio
    assert rope_scale(spec._ratios(), carrier(30000, 30000)) == (tc / 30, s, s)
    denoiser = lora_denoiser(spec)
    mixed = assert_layers_match(spec, denoiser, inputs)
    with torch.no_grad():
        layers = spec.pipeline_layers(denoiser)
        for i, fps in enumerate([24.0, 25.0]):
            one = tuple(x[i:i + 1] for x in inputs[:4])
            f, h, w = sizes(inputs[4])
            alone = denoiser(hidden_states=one[0], encoder_hidden_states=one[2],
                             timestep=(one[1] * 1000).flatten(), encoder_attention_mask=one[3],
                             num_frames=f, height=h, width=w, return_dict=False,
                             rope_interpolation_scale=(tc / fps, s, s))[0]
            torch.testing.assert_close(mixed[i:i + 1], alone, rtol=1e-5, atol=1e-5)
        at_25 = run(layers, spec.make_inputs(_batch_at(spec, encoders, [25.0, 25.0]))[0])
    assert (at_25[0] - mixed[0]).abs().max() > 1e-5  # the rate moves the temporal positions


def test_frame_modes_condition_each_sample_on_its_own(spec, encoders):
    """dataset.conditioning on LTX-Video: per sample, a first frame (as model.i2v trains every
    sample) or none (as text-to-video); a micro-batch may mix them."""
    from dpipe.models.frame_modes import FIRST, NONE

    assert spec.frame_modes() == {"none": 1.0, "first": 0.0}
    pixels = torch.rand(2, 3, 17, 64, 64) * 2 - 1
    latents = spec.encode_videos(encoders, pixels)
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0.3, 0.8])
    noisy, target = spec.noise(latents, noise, t)
    text = spec.encode_prompts(encoders, CAPTIONS)
    batch = NoisedBatch(latents=latents, noise=noise, timesteps=t, noisy=noisy, target=target,
                        text=text, frame_mode=torch.tensor([FIRST, NONE]))
    (packed, t_tokens, *_), labels = spec.make_inputs(batch)
    alone = [spec.make_inputs(NoisedBatch(
        latents=latents[i:i + 1], noise=noise[i:i + 1], timesteps=t[i:i + 1],
        noisy=noisy[i:i + 1], target=target[i:i + 1], text={k: v[i:i + 1] for k, v in text.items()},
        frame_mode=torch.tensor([mode]))) for i, mode in enumerate([FIRST, NONE])]
    # Sample 0 as model.i2v trains it (first frame clean at t = 0, left out of the loss),
    # sample 1 as text-to-video.
    (packed0, t0, *_), labels0 = alone[0]
    torch.testing.assert_close(packed[:1], packed0)
    torch.testing.assert_close(t_tokens[:1], t0)
    assert torch.equal(labels[2][:1], labels0[2])
    (packed1, t1, *_), _ = alone[1]
    torch.testing.assert_close(packed[1:], packed1)
    assert torch.equal(t_tokens[1], torch.full_like(t_tokens[1], 0.8)) and t1.shape == (1, 1)
    assert labels[2][1].all() and not labels[2][0, :64].any()
