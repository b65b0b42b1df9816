"""Wan-specific checks on the tiny models, in this process: video-shaped inputs (5 frames -> 2
latent frames), i2v conditioning (CLIP tokens and first-frame latents as the pipelines make them),
TI2V first-frame conditioning, the A14B experts and their t ranges, both LoRA formats, activation
checkpointing. The generic 2-process checks are in test_families.py."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest
import torch

from dpipe.config.schema import LoraConfig, ModelConfig, TrainMode
from dpipe.errors import ConfigError, DataError
from dpipe.models.spec import NoisedBatch
from dpipe.models.comfyui import COMFY_PREFIX
from dpipe.models.wan.spec import COMFYUI_LORA, WanSpec
from dpipe.models.wan.tiny import make_tiny_wan
from dpipe.train.lora import make_trainable
from tests.unit.video_checks import assert_same_tensors
from tests.exports import export_lora

CAPTIONS = ["a red circle on a blue background", "a green square"]
CASES = {  # name: (variant, model config overrides)
    "t2v": ("wan21_t2v", {}),
    "i2v": ("wan21_i2v", {}),
    "flf2v": ("wan21_flf2v", {}),
    "ti2v": ("wan22_ti2v", {}),
    "ti2v_i2v": ("wan22_ti2v", {"i2v": True}),
    "a14b_low": ("wan22_a14b", {"max_t": 0.875}),
    "a14b_high": ("wan22_a14b", {"min_t": 0.875}),
    "i2v_a14b_low": ("wan22_i2v_a14b", {"max_t": 0.9}),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("wan-models")


def _spec(models: Path, case: str, **extra) -> WanSpec:
    variant, overrides = CASES[case]
    make_tiny_wan(models / variant, variant=variant)
    spec = WanSpec(ModelConfig(family="wan", path=str(models / variant),
                               **{**overrides, **extra}))
    spec.ensure_available()
    return spec


_ENCODERS: dict = {}


def _encoders(spec: WanSpec):
    key = spec.path
    if key not in _ENCODERS:
        _ENCODERS[key] = spec.load_encoders(torch.device("cpu"), torch.float32)
    return _ENCODERS[key]


def _batch(spec: WanSpec, frames: int, seed: int = 0) -> NoisedBatch:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.rand(2, 3, frames, 64, 64, generator=gen) * 2 - 1
    encoders = _encoders(spec)
    latents = spec.encode_videos(encoders, pixels)
    noise = torch.randn(latents.shape, generator=gen)
    t = torch.rand(2, generator=gen)
    noisy, target = spec.noise(latents, noise, t)
    return NoisedBatch(latents=latents, noise=noise, timesteps=t, noisy=noisy, target=target,
                       text=spec.encode_prompts(encoders, CAPTIONS))


def _run(layers, inputs):
    x = inputs
    for layer in layers:
        x = layer(x)
    return x


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "flf2v" else c
                                  for c in CASES])
@pytest.mark.parametrize("frames", [1, 5])
def test_layers_reproduce_the_diffusers_forward_on_videos(models, case, frames):
    spec = _spec(models, case)
    inputs, labels = spec.make_inputs(_batch(spec, frames))
    denoiser = spec.load_denoiser(torch.float32)
    with torch.no_grad():
        out = _run(spec.pipeline_layers(denoiser), inputs)
        expected = spec.denoiser_forward(denoiser, inputs)
    latent_frames = (frames - 1) // 4 + 1
    assert out.shape == (2, spec.variant.z_dim, latent_frames, *inputs[0].shape[-2:])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(spec.loss(out, labels))


def test_images_are_one_frame_videos_and_clips_need_4k_plus_1_frames(models):
    spec = _spec(models, "i2v")
    encoders = _encoders(spec)
    image = torch.rand(2, 3, 64, 64) * 2 - 1
    torch.testing.assert_close(spec.encode_images(encoders, image),
                               spec.encode_images(encoders, image.unsqueeze(2)))
    with pytest.raises(DataError, match="4k\\+1"):
        spec.encode_images(encoders, torch.zeros(1, 3, 4, 64, 64))


def test_i2v_conditioning_is_what_the_pipeline_builds(models):
    """Wan 2.1 i2v: the cached conditioning equals WanImageToVideoPipeline's own (CLIP tokens of
    the first frame as a PIL image, latents of [first frame, zeros...]); the inputs carry the
    mask channels and those latents."""
    from PIL import Image

    spec = _spec(models, "i2v")
    encoders = _encoders(spec)
    pipe = encoders.image
    z = spec.variant.z_dim
    gen = torch.Generator().manual_seed(3)
    uint8 = torch.randint(0, 256, (1, 3, 5, 64, 64), generator=gen, dtype=torch.uint8)
    pixels = uint8.float() / 127.5 - 1
    cached = spec.encode_videos(encoders, pixels)
    first = Image.fromarray(uint8[0, :, 0].permute(1, 2, 0).numpy())
    batch = _batch(spec, 5)
    batch = NoisedBatch(latents=cached, noise=batch.noise[:1], timesteps=batch.timesteps[:1],
                        noisy=batch.noisy[:1], target=batch.target[:1],
                        text={k: v[:1] for k, v in batch.text.items()})
    inputs, _ = spec.make_inputs(batch)
    torch.testing.assert_close(inputs[3], pipe.encode_image(first, device="cpu"))
    # The pipeline's conditioning: mask (4 channels) then the first-frame video's latents.
    image = pipe.video_processor.preprocess(first, height=64, width=64)
    _, condition = pipe.prepare_latents(image, 1, z, 64, 64, 5, torch.float32, "cpu",
                                        torch.Generator().manual_seed(0))
    torch.testing.assert_close(inputs[0][:, z:], condition, rtol=1e-5, atol=1e-5)
    # Causal VAE: the first latent frame of the condition is the clip's own first latent frame.
    torch.testing.assert_close(cached[:, z:2 * z, 0], cached[:, :z, 0])


def test_ti2v_first_frame_is_given_and_left_out_of_the_loss(models):
    spec = _spec(models, "ti2v_i2v")
    batch = _batch(spec, 5)
    inputs, labels = spec.make_inputs(batch)
    hidden, t = inputs[0], inputs[1]
    torch.testing.assert_close(hidden[:, :, 0], batch.latents[:, :, 0])
    torch.testing.assert_close(hidden[:, :, 1], batch.noisy[:, :, 1])
    assert t.shape == (2, 2) and (t[:, 0] == 0).all() and (t[:, 1] == batch.timesteps).all()
    out = torch.randn_like(batch.target)
    changed = out.clone()
    changed[:, :, 0] += 5  # whatever the model says about the given frame does not count
    assert spec.loss(out, labels) == pytest.approx(float(spec.loss(changed, labels)))
    expected = (out[:, :, 1:] - batch.target[:, :, 1:]).square().mean()
    assert float(spec.loss(out, labels)) == pytest.approx(float(expected), rel=1e-6)
    # One-frame items have nothing left to predict: they train text-to-image.
    inputs, labels = spec.make_inputs(_batch(spec, 1))
    assert inputs[1].shape == (2,) and len(labels) == 1
    # dataset.conditioning first/none per sample: sample 0 as above, sample 1 as text-to-video.
    from dataclasses import replace

    from dpipe.models.frame_modes import FIRST, NONE

    assert spec.frame_modes() == {"none": 0.0, "first": 1.0}
    mixed, mixed_labels = spec.make_inputs(replace(batch, frame_mode=torch.tensor([FIRST, NONE])))
    torch.testing.assert_close(mixed[0][0], hidden[0])
    torch.testing.assert_close(mixed[0][1], batch.noisy[1])
    assert mixed[1][0].tolist() == t[0].tolist() and (mixed[1][1] == batch.timesteps[1]).all()
    assert (mixed_labels[1][0, :, 0] == 0).all() and (mixed_labels[1][1] == 1).all()


def test_experts_and_their_timestep_ranges(models):
    low, high = _spec(models, "a14b_low"), _spec(models, "a14b_high")
    assert (low.expert, high.expert) == ("transformer_2", "transformer")
    with pytest.raises(ConfigError, match="spans both experts"):
        _ = _spec(models, "a14b_low", max_t=0.95).expert
    assert _spec(models, "t2v", min_t=0.3).expert == "transformer"  # one expert: any range
    for spec, (lo, hi) in ((low, (0.0, 0.875)), (high, (0.875, 1.0))):
        batch = _batch(spec, 1)
        inputs, _ = spec.make_inputs(batch)
        t = inputs[1]
        assert ((t >= lo) & (t <= hi)).all()
        torch.testing.assert_close(t, lo + (hi - lo) * batch.timesteps)
        # The latents were noised at the same t the transformer is told.
        x0, noise = batch.latents, batch.noise
        torch.testing.assert_close(batch.noisy, (1 - t.view(-1, 1, 1, 1, 1)) * x0
                                   + t.view(-1, 1, 1, 1, 1) * noise)


def test_families_without_ranges_refuse_them(tmp_path):
    from dpipe.models.flux.spec import FluxSpec

    with pytest.raises(ConfigError, match="min_t"):
        FluxSpec(ModelConfig(family="flux", path=str(tmp_path), min_t=0.5))
    with pytest.raises(ConfigError, match="min_t"):
        WanSpec(ModelConfig(family="wan", path=str(tmp_path), min_t=0.9, max_t=0.5))


def test_i2v_task_is_checked_against_the_checkpoint(models):
    with pytest.raises(ConfigError, match="text-to-video"):
        _spec(models, "t2v", i2v=True)
    with pytest.raises(ConfigError, match="image-to-video"):
        _spec(models, "i2v", i2v=False)
    assert _spec(models, "ti2v").i2v is False and _spec(models, "ti2v_i2v").i2v is True


def _with_random_lora(spec: WanSpec, seed: int):
    torch.manual_seed(seed)
    denoiser = spec.load_denoiser(torch.float32)
    make_trainable(denoiser, spec.cfg, spec.lora_targets())
    with torch.no_grad():
        for name, param in denoiser.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    return denoiser


@pytest.mark.parametrize("case", ["t2v", "i2v", "a14b_low"])
def test_both_lora_files_load_into_the_pipeline_and_reproduce_the_model(models, tmp_path, case):
    """diffusers' load_lora_weights reads our diffusers file as is and our ComfyUI file through
    its converter for original-format Wan LoRAs: both give the trained model (alpha != rank)."""
    spec = _spec(models, case, lora=LoraConfig(rank=4, alpha=8))
    denoiser = _with_random_lora(spec, seed=1)
    layers = spec.pipeline_layers(denoiser)
    state = {}
    for layer in layers:
        state.update(layer.denoiser_state_dict(trainable_only=True))
    assert state and all("lora_" in k for k in state)
    files = export_lora(spec, state, tmp_path)
    assert [f.name for f in files] == ["pytorch_lora_weights.safetensors", COMFYUI_LORA]
    inputs, _ = spec.make_inputs(_batch(spec, 5))
    with torch.no_grad():
        trained = _run(layers, inputs)
        for weight_name in (None, COMFYUI_LORA):
            loaded = spec.load_denoiser_with_lora(tmp_path, weight_name=weight_name)
            torch.testing.assert_close(spec.denoiser_forward(loaded, inputs), trained,
                                       rtol=1e-4, atol=1e-5)


def test_comfyui_keys_are_the_original_wan_names(models, tmp_path):
    """Every ComfyUI key names a weight of the original Wan checkpoint: diffusers' single-file
    converter (original -> diffusers names) maps it back to the module the LoRA trained."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
    from safetensors.torch import load_file

    spec = _spec(models, "i2v", lora=LoraConfig(rank=4, alpha=4))
    denoiser = _with_random_lora(spec, seed=2)
    state = {}
    for layer in spec.pipeline_layers(denoiser):
        state.update(layer.denoiser_state_dict(trainable_only=True))
    export_lora(spec, state, tmp_path)
    comfy = load_file(tmp_path / COMFYUI_LORA)
    assert all(k.startswith(COMFY_PREFIX) for k in comfy)
    originals = {k[len(COMFY_PREFIX):].replace(".lora_A.weight", ".weight"): None
                 for k in comfy if k.endswith(".lora_A.weight")}
    back = convert_wan_transformer_to_diffusers(dict(originals))
    trained = {k.replace(".default.", ".").replace(".lora_A.weight", ".weight")
               for k in state if ".lora_A." in k}
    assert set(back) == trained
    assert any(".k_img." in k for k in originals) and any("ffn.0" in k for k in originals)


@pytest.mark.parametrize("case", ["i2v", "ti2v_i2v"])
def test_layers_train_the_same_under_activation_checkpointing(models, case):
    """The engine recomputes a layer with torch.utils.checkpoint(layer, x, use_reentrant=False)
    (pipeline.activation_checkpointing): same loss and gradients as keeping the activations."""
    from torch.utils.checkpoint import checkpoint

    spec = _spec(models, case, mode=TrainMode.full)
    denoiser = spec.load_denoiser(torch.float32)
    layers = spec.pipeline_layers(denoiser)
    inputs, labels = spec.make_inputs(_batch(spec, 5))
    grads = []
    for checkpointed in (False, True):
        denoiser.zero_grad()
        x = inputs
        for layer in layers:
            x = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
        loss = spec.loss(x, labels)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in denoiser.parameters()]))
    (loss0, g0), (loss1, g1) = grads
    torch.testing.assert_close(loss1, loss0)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a)


def test_full_export_is_the_expert_the_pipeline_loads(models, tmp_path):
    """A full fine-tune of the low-noise expert exports transformer_2/, which the pipeline folder
    takes as is."""
    from safetensors.torch import save_file

    spec = _spec(models, "i2v_a14b_low", mode=TrainMode.full)
    denoiser = spec.load_denoiser(torch.float32)
    layers = spec.pipeline_layers(denoiser)
    half = len(layers) // 2
    shards = []
    for i, part in enumerate((layers[:half], layers[half:])):
        weights = {}
        for layer in part:
            weights.update(layer.denoiser_state_dict(trainable_only=False))
        shards.append(tmp_path / f"stage-{i}.safetensors")
        save_file({k: v.contiguous() for k, v in weights.items()}, shards[-1])
    out = spec.export_full(shards, tmp_path / "model")
    assert out.name == "transformer_2"
    loaded = spec.load_exported_full(tmp_path / "model")
    assert set(loaded.state_dict()) == set(denoiser.state_dict())
    for name, value in denoiser.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value)


def _single_file(models: Path, tmp_path: Path, case: str, dtype=torch.float32,
                 prefix: str = "") -> Path:
    """The tiny transformer in the original / ComfyUI single-file layout, keys behind `prefix`
    ("model.diffusion_model." as ComfyUI saves models)."""
    from safetensors.torch import save_file

    from dpipe.models.wan.comfyui import original_state_dict

    state = _spec(models, case).load_denoiser(torch.float32).state_dict()
    file = tmp_path / f"wan_{case}_tiny.safetensors"
    save_file({prefix + k: v.to(dtype).contiguous()
               for k, v in original_state_dict(state).items()}, file)
    return file


def test_single_file_transformer_loads_as_the_folder_one(models, tmp_path):
    """A ComfyUI-layout transformer file (model.path) with the diffusers folder of the same model
    (model.single_file_config) gives the folder's transformer: diffusers' single-file converter
    reads the original names our full export writes."""
    for case in ("i2v", "a14b_low"):
        folder = _spec(models, case)
        file = _single_file(models, tmp_path, case)
        spec = WanSpec(ModelConfig(family="wan", path=str(file),
                                   single_file_config=str(folder.path), **CASES[case][1]))
        spec.ensure_available()
        assert spec.variant == folder.variant and spec.expert == folder.expert
        want, got = folder.load_denoiser(torch.float32).state_dict(), spec.load_denoiser(
            torch.float32).state_dict()
        assert set(got) == set(want)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value)
        # at bf16 too, the float32 parts and the rotary tables as from_pretrained keeps them
        assert_same_tensors(spec.load_denoiser(torch.bfloat16),
                            folder.load_denoiser(torch.bfloat16))
    with pytest.raises(ConfigError, match="single_file_config"):
        WanSpec(ModelConfig(family="wan", path=str(file)))


def test_full_export_of_a_single_file_model_writes_that_layout_too(models, tmp_path):
    """The file written beside the diffusers folder has the source's keys, in its order, behind
    its `model.diffusion_model.` prefix and in its dtype, and loads back as the trained weights."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from diffusers import WanTransformer3DModel

    file = _single_file(models, tmp_path, "t2v", dtype=torch.bfloat16,
                        prefix="model.diffusion_model.")
    spec = WanSpec(ModelConfig(family="wan", path=str(file), mode=TrainMode.full,
                               single_file_config=str(models / "wan21_t2v")))
    spec.ensure_available()
    denoiser = spec.load_denoiser(torch.float32)
    with torch.no_grad():
        for param in denoiser.parameters():
            param.add_(0.01)  # "trained"
    weights = {}
    for layer in spec.pipeline_layers(denoiser):
        weights.update(layer.denoiser_state_dict(trainable_only=False))
    shard = tmp_path / "stage-0.safetensors"
    save_file({k: v.contiguous() for k, v in weights.items()}, shard)
    spec.export_full([shard], tmp_path / "model")
    exported = tmp_path / "model" / file.name
    with safe_open(file, "pt") as f:
        source = list(f.keys())
    with safe_open(exported, "pt") as f:
        assert list(f.keys()) == source
        assert f.get_tensor("model.diffusion_model.blocks.0.self_attn.q.weight").dtype == \
            torch.bfloat16
    reloaded = WanTransformer3DModel.from_single_file(
        str(exported), config=str(models / "wan21_t2v"), subfolder="transformer",
        torch_dtype=torch.float32)
    for name, value in denoiser.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], value.to(torch.bfloat16).float())
    folder = spec.load_exported_full(tmp_path / "model")
    for name, value in denoiser.state_dict().items():
        torch.testing.assert_close(folder.state_dict()[name], value)


@pytest.mark.slow
def test_trains_from_a_single_file_transformer(models, tmp_path):
    """2 stages from a ComfyUI-layout transformer file; the exported LoRA, loaded into a pipeline
    whose transformer comes from that file, reproduces the trained model."""
    from dpipe.data.batches import step_micro_batches
    from tests.cli import dpipe_train, train_args
    from tests.integration.trained import cached_dataset, run_config, run_layers, trained_layers

    file = _single_file(models, tmp_path, "t2v")
    run_dir = tmp_path / "run"
    result = dpipe_train(*train_args(
        run_dir, "model=tiny_wan", f"model.path={file}", "model.tiny=false",
        f"model.single_file_config={models / 'wan21_t2v'}", "dataset=synthetic",
        "pipeline.stages=2", "pipeline.micro_batches=2", "optim.lr=1e-3",
        "train.checkpoint_every_steps=0", "train.max_steps=2"))
    assert result.code == 0, f"dpipe-train failed ({result.code}):\n{result.out}\n{result.err}"
    spec, layers = trained_layers(run_dir)
    assert spec.single_file
    dataset, plan = cached_dataset(run_dir)
    inputs, _ = next(step_micro_batches(spec, dataset, plan, run_config(run_dir).train.timesteps,
                                        1, 0, 0))
    with torch.no_grad():
        got = spec.denoiser_forward(spec.load_denoiser_with_lora(run_dir / "lora"), inputs)
    torch.testing.assert_close(got, run_layers(layers, inputs), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_two_stage_run_with_activation_checkpointing(tmp_path):
    """pipeline.activation_checkpointing=all (every layer recomputed in backward): the 2-stage run's
    first loss is the 1-stage loss of the same micro-batches, as without checkpointing."""
    from tests.cli import dpipe_train, metrics, train_args
    from tests.integration.trained import one_process_first_loss

    run_dir = tmp_path / "run"
    result = dpipe_train(*train_args(
        run_dir, "model=tiny_wan_i2v", "dataset=synthetic", "pipeline.stages=2",
        "pipeline.micro_batches=2", "pipeline.activation_checkpointing=all", "optim.lr=1e-3",
        "train.checkpoint_every_steps=0", "train.max_steps=2"))
    assert result.code == 0, f"dpipe-train failed ({result.code}):\n{result.out}\n{result.err}"
    assert metrics(run_dir)[0]["loss"] == pytest.approx(one_process_first_loss(run_dir),
                                                        rel=1e-5, abs=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["flf2v", "i2v_a14b_low"])
def test_first_last_frame_conditioning_is_what_the_pipeline_builds(models, case):
    """Given its first and last frames (Wan 2.1 FLF2V; Wan 2.2 I2V-A14B with frame mode "both"),
    the inputs hold WanImageToVideoPipeline's own conditioning with `last_image`: the mask with
    the last pixel frame given, the latents of [first, black..., last] and (FLF2V) the CLIP
    tokens of both frames; the mode "first" of I2V-A14B is the pipeline without `last_image`."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    from dpipe.models.frame_modes import BOTH, FIRST

    spec = _spec(models, case)
    encoders = _encoders(spec)
    text = encoders.text
    pipe = encoders.image or WanImageToVideoPipeline(
        tokenizer=text.tokenizer, text_encoder=text.text_encoder, vae=text.vae, scheduler=None)
    z = spec.variant.z_dim
    uint8 = torch.randint(0, 256, (1, 3, 5, 32, 32), generator=torch.Generator().manual_seed(4),
                          dtype=torch.uint8)
    pixels = uint8.float() / 127.5 - 1
    first, last = (Image.fromarray(uint8[0, :, i].permute(1, 2, 0).numpy()) for i in (0, -1))
    cached = spec.encode_videos(encoders, pixels)
    noisy = torch.randn(1, z, 2, 4, 4)
    modes = [BOTH] if case == "flf2v" else [BOTH, FIRST]
    for mode in modes:
        batch = NoisedBatch(latents=cached, noise=noisy, timesteps=torch.tensor([0.5]),
                            noisy=noisy, target=noisy,
                            text=spec.encode_prompts(encoders, CAPTIONS[:1]),
                            frame_mode=torch.tensor([mode]))
        inputs, _ = spec.make_inputs(batch)
        frames = {"last_image": pipe.video_processor.preprocess(last, height=32, width=32)}
        if mode == FIRST:
            frames = {}
        image = pipe.video_processor.preprocess(first, height=32, width=32)
        _, condition = pipe.prepare_latents(image, 1, z, 32, 32, 5, torch.float32, "cpu",
                                            torch.Generator().manual_seed(0), **frames)
        torch.testing.assert_close(inputs[0][:, z:], condition, rtol=1e-5, atol=1e-5)
        assert torch.equal(inputs[0][:, :z], noisy)
    if case == "flf2v":  # the pipeline's image_embeds: encode_image([image, last_image])
        tokens = pipe.encode_image([first, last], device="cpu")
        torch.testing.assert_close(inputs[3], tokens.reshape(1, -1, tokens.shape[-1]))


@pytest.mark.slow  # ~2 s after the module's other FLF2V tests made the tiny folder, ~15 s alone
def test_flf2v_sample_from_a_first_and_a_last_frame_is_the_pipelines(models, tmp_path):
    """Wan 2.1 FLF2V sampled from a first and a last frame (5 frames of 32x32, 2 steps): dpipe's
    loop through the pipeline layers ends at WanImageToVideoPipeline's final latents given
    `image` and `last_image`, the control being the cache's encoding of the first frame."""
    import numpy as np
    from PIL import Image

    from dpipe.images import load_image
    from dpipe.models.sampling import SampleRequest
    from dpipe.sample.denoise import denoise
    from dpipe.sample.link import StageLink

    spec = _spec(models, "flf2v")
    frames = []
    for i in range(2):
        frames.append(tmp_path / f"frame{i}.png")
        pixels = np.random.default_rng(i).integers(0, 255, (32, 32, 3), np.uint8)
        Image.fromarray(pixels).save(frames[-1])
    request = SampleRequest(0, CAPTIONS[0], "blurry", seed=3, width=32, height=32, frames=5,
                            control=str(frames[0]), last_frame=str(frames[1]))
    sampling = spec.sampling()
    assert sampling.check(request) is None
    encoders = _encoders(spec)
    text, uncond = (spec.encode_prompts(encoders, [p]) for p in (CAPTIONS[0], "blurry"))
    control = spec.encode_images(encoders, load_image(frames[0], 32, 32)[None])
    denoiser = spec.load_denoiser(torch.float32)
    layers = spec.pipeline_layers(denoiser)
    d = sampling.start(request, 2, 5.0, text, uncond, control, torch.device("cpu"))
    assert denoise(sampling, [d], StageLink.local(torch.device("cpu")),
                   lambda x: _run(layers, x), 2) == [False]
    with torch.no_grad():
        expected = sampling.diffusers_sample(denoiser, request, 2, 5.0)
    torch.testing.assert_close(d.latents, expected, rtol=1e-4, atol=1e-5)
