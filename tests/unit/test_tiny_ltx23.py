"""The tiny LTX-2.3 folder (LTX-2's classes with the 2.3 release's switches on) loads through
diffusers' real loading code and generates video + audio with LTX2Pipeline's defaults; dpipe's
video-only layers (gated attention, prompt modulation, no caption projection) equal the
transformer's forward; the LoRA reaches the attention gates and its files load; single files
under the original names load (and 2.3's extra weights come back under them); an LTX-2.0 folder
or file is refused, and so is another family's folder; the real-size config builds on the meta
device and its FLOPs count."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file

from dpipe.config.schema import ModelConfig
from dpipe.errors import ModelLoadError
from dpipe.models.comfyui import peft_pairs
from dpipe.models.ltx_video.ltx2.ltx23 import COMFYUI_LORA, LTX23Spec
from dpipe.models.ltx_video.ltx2.tiny import make_tiny_ltx2, write_single_file
from dpipe.models.lora_files import DIFFUSERS_LORA
from tests.unit.video_checks import (
    CAPTIONS, assert_layers_match, deltas, lora_denoiser, lora_state_dict, micro_batch, tiny_spec)
from tests.exports import export_lora


def make_spec(path, family="ltx23", **values):
    return tiny_spec(path, family, **values)


@pytest.fixture(scope="module")
def spec(tiny) -> LTX23Spec:
    return make_spec(tiny)


@pytest.fixture(scope="module")
def encoders(spec):
    return spec.load_encoders(torch.device("cpu"), torch.float32)


def test_layout_and_switches_as_the_release(tiny):
    index = json.loads((tiny / "model_index.json").read_text())
    assert index["_class_name"] == "LTX2Pipeline"
    assert index["vocoder"][1] == "LTX2VocoderWithBWE"
    transformer = json.loads((tiny / "transformer/config.json").read_text())
    assert {k: transformer[k] for k in ("gated_attn", "cross_attn_mod", "audio_gated_attn",
                                        "audio_cross_attn_mod", "perturbed_attn",
                                        "use_prompt_embeddings")} == {
        "gated_attn": True, "cross_attn_mod": True, "audio_gated_attn": True,
        "audio_cross_attn_mod": True, "perturbed_attn": True, "use_prompt_embeddings": False}
    connectors = json.loads((tiny / "connectors/config.json").read_text())
    assert connectors["per_modality_projections"] and connectors["video_gated_attn"]
    with open(tiny / "transformer/diffusion_pytorch_model.safetensors.index.json") as f:
        names = json.load(f)["weight_map"]
    assert "prompt_adaln.linear.weight" in names and "caption_projection.linear_1.weight" not in names
    assert "transformer_blocks.0.attn1.to_gate_logits.weight" in names
    assert "transformer_blocks.0.prompt_scale_shift_table" in names


def test_encoders(spec, encoders):
    assert spec.encode_images(encoders, torch.zeros(2, 3, 64, 64)).shape == (2, 8, 1, 8, 8)
    text = spec.encode_prompts(encoders, CAPTIONS)
    # The video connector's tokens, at the video stream's width (its own projection in 2.3).
    embeds, mask, _, _ = encoders.encode_prompt(CAPTIONS, do_classifier_free_guidance=False,
                                                max_sequence_length=16)
    video, audio, _ = encoders.connectors(embeds, mask, padding_side="left")
    torch.testing.assert_close(text["video_text"], video)
    assert video.shape[-1] == 32 and audio.shape[-1] == 16


@pytest.mark.parametrize("frames", [1, 9])
def test_layers_match_diffusers_video_stream(spec, encoders, frames):
    inputs, _ = micro_batch(spec, encoders, torch.rand(2, 3, frames, 64, 64) * 2 - 1)
    layers = spec.pipeline_layers(spec.load_denoiser(torch.float32))
    assert "prompt_adaln" in layers[0].source_names.values()
    assert_layers_match(spec, lora_denoiser(spec), inputs)


def test_lora_reaches_the_gates_and_its_files_load(spec, encoders, tmp_path):
    denoiser = lora_denoiser(spec)
    names = {n.split(".lora_A")[0] for n, _ in denoiser.named_parameters() if "lora_A" in n}
    assert "transformer_blocks.0.attn1.to_gate_logits" in names
    assert "transformer_blocks.3.attn2.to_gate_logits" in names
    assert not any("audio" in n for n in names)
    assert export_lora(spec, lora_state_dict(denoiser), tmp_path) == [tmp_path / DIFFUSERS_LORA,
                                                                     tmp_path / COMFYUI_LORA]
    comfy = load_file(tmp_path / COMFYUI_LORA)
    assert "diffusion_model.transformer_blocks.0.attn2.to_gate_logits.lora_A.weight" in comfy
    got = deltas({k.removeprefix("diffusion_model."): v for k, v in peft_pairs(comfy).items()})
    assert got.keys() == deltas(peft_pairs(lora_state_dict(denoiser))).keys()
    inputs, _ = micro_batch(spec, encoders, torch.rand(2, 3, 9, 64, 64) * 2 - 1)
    with torch.no_grad():
        expected = spec.denoiser_forward(denoiser, inputs)
        for weight_name in (DIFFUSERS_LORA, COMFYUI_LORA):
            loaded = spec.load_denoiser_with_lora(tmp_path, weight_name)
            torch.testing.assert_close(spec.denoiser_forward(loaded, inputs), expected,
                                       rtol=1e-4, atol=1e-5)


def test_comfyui_names_are_the_original_ones(spec, tmp_path):
    """Every Linear (not only the trained ones) under the names of Lightricks' files, which
    ComfyUI's LTX-2 model holds: `prompt_adaln_single`, `patchify_proj`, ..."""
    denoiser = spec.load_denoiser(torch.float32)
    peft = {}
    for name, module in denoiser.named_modules():
        if isinstance(module, torch.nn.Linear):
            peft[f"{name}.lora_A.default.weight"] = torch.randn(2, module.in_features)
            peft[f"{name}.lora_B.default.weight"] = torch.randn(module.out_features, 2)
    export_lora(spec, peft, tmp_path)
    modules = {k.removeprefix("diffusion_model.").split(".lora_")[0]
               for k in load_file(tmp_path / COMFYUI_LORA)}
    file = write_single_file(spec.path, tmp_path / "ltx-2.3-22b-dev.safetensors")
    with safe_open(file, "pt") as f:
        original = {k.removeprefix("model.diffusion_model.").removesuffix(".weight")
                    for k in f.keys()}
    assert "prompt_adaln_single.linear" in modules and "patchify_proj" in modules
    assert modules <= original


def test_single_file_loads_as_the_folder(spec, tiny, tmp_path):
    file = write_single_file(tiny, tmp_path / "ltx-2.3-22b-dev.safetensors")
    with safe_open(file, "pt") as f:
        keys = set(f.keys())
    assert "model.diffusion_model.prompt_adaln_single.linear.weight" in keys
    assert "model.diffusion_model.audio_prompt_adaln_single.linear.weight" in keys
    single = make_spec(file, single_file_config=str(tiny))
    got = single.load_denoiser(torch.float32).state_dict()
    want = spec.load_denoiser(torch.float32).state_dict()
    assert got.keys() == want.keys()
    for key, value in want.items():  # the file is bf16
        torch.testing.assert_close(got[key], value.to(torch.bfloat16).float(), msg=key)


def test_another_release_or_family_is_refused(tiny, tiny_models, tmp_path):
    ltx20 = make_tiny_ltx2(tiny_models / "tiny-ltx2")
    with pytest.raises(ModelLoadError, match=r"transformer/config.json describes an LTX-2.0 "
                                             r"transformer, not LTX-2.3: use model=ltx2"):
        make_spec(ltx20)
    with pytest.raises(ModelLoadError, match="describes an LTX-2.3 transformer, not LTX-2.0: "
                                             "use model=ltx23"):
        make_spec(tiny, family="ltx2")
    old_file = write_single_file(ltx20, tmp_path / "ltx-2-19b-dev.safetensors")
    with pytest.raises(ModelLoadError, match=r"ltx-2-19b-dev.safetensors holds an LTX-2.0 "
                                             r"transformer, not LTX-2.3: use model=ltx2"):
        make_spec(old_file, single_file_config=str(tiny))
    other = tmp_path / "wan"
    for part in ("transformer", "vae", "text_encoder", "tokenizer", "connectors", "scheduler"):
        (other / part).mkdir(parents=True)
    (other / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    with pytest.raises(ModelLoadError, match="model_index.json names a WanPipeline, not "
                                             "LTX2Pipeline"):
        make_spec(other)


def test_real_size_builds_on_meta_and_counts_its_flops():
    """dpipe-bench's 22B config: the layers run on the meta device over a real-size sample and
    the model-FLOP convention counts the video stream."""
    from dpipe.bench.worker import fixed_micro_batches

    spec = LTX23Spec(OmegaConf.to_object(OmegaConf.merge(
        OmegaConf.structured(ModelConfig), {"family": "ltx23", "path": "/unused"})))
    assert spec.bench_sizes() == ("22b", "tiny")
    spec = spec.for_benchmark("22b")
    assert spec.pixel_multiple == 32 and spec.temporal_ratio == 8
    assert spec.pipeline_layer_count() == 50
    denoiser = spec.random_denoiser("22b", torch.bfloat16, torch.device("meta"))
    params = sum(p.numel() for p in denoiser.parameters())
    # 18.99B: the "22B" of the release's name counts its text connectors too
    assert 18.9e9 < params < 19.1e9, params
    (inputs, labels), = fixed_micro_batches(spec, "22b", 1, 1, seed=0)
    assert inputs[0].shape == (1, 6144, 128)
    layers = spec.pipeline_layers(denoiser)
    costs = spec.layer_costs(layers)
    assert len(layers) == 50 and costs[1] == 1.0 and costs[0] < 0.5 and costs[-1] < 0.5
    x = tuple(t.to("meta") for t in inputs)
    with torch.no_grad():
        for layer in layers:
            x = layer(x)
    assert x.shape == (1, 6144, 128)
    flops = spec.train_flops(denoiser, inputs, full=False)
    # 4 x ~14B video-stream weights x 6144 tokens, plus attention: ~0.4 PFLOP per clip
    assert 3e14 < flops < 6e14, flops


def test_real_size_with_sound_runs_both_streams_on_meta():
    """dpipe-bench with model.audio=true: each random clip has its soundtrack (126 audio latents
    for 121 frames, as LTX2Pipeline computes them), the joint layers run both streams at real
    size, and the FLOP count adds the audio stream's work."""
    from dpipe.bench.worker import fixed_micro_batches

    config = {"family": "ltx23", "path": "/unused"}
    specs = [LTX23Spec(OmegaConf.to_object(OmegaConf.merge(
        OmegaConf.structured(ModelConfig), {**config, "audio": audio}))).for_benchmark("22b")
        for audio in (False, True)]
    silent, sound = specs
    denoiser = sound.random_denoiser("22b", torch.bfloat16, torch.device("meta"))
    (inputs, labels), = fixed_micro_batches(sound, "22b", 1, 1, seed=0)
    assert inputs[0].shape == (1, 6144, 128)
    assert inputs[-2].shape == (1, 126, 128) and inputs[-1].shape == (1, 1024, 2048)
    assert labels[-1].shape == (1, 126, 128) and labels[-1].abs().sum() > 0
    x = tuple(t.to("meta") for t in inputs)
    with torch.no_grad():
        for layer in sound.pipeline_layers(denoiser):
            x = layer(x)
    video, audio = x
    assert video.shape == (1, 6144, 128) and audio.shape == (1, 126, 128)
    (video_only, _), = fixed_micro_batches(silent, "22b", 1, 1, seed=0)
    assert sound.train_flops(denoiser, inputs, False) > silent.train_flops(denoiser, video_only,
                                                                           False)
