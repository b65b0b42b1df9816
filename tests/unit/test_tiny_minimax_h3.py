"""The tiny MiniMax H3 folder loads and generates through diffusers' MiniMaxH3ModularPipeline;
dpipe's layers equal the diffusers forward (per sample, with and without the audio rows); the
exported LoRA loads into the pipeline's transformer and reproduces the trained layers; the
encoders follow the pipeline's conventions (docs/models/minimax_h3.md)."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dpipe.errors import ConfigError, DataError, ModelLoadError
from dpipe.models.minimax_h3.tiny import REPO, make_tiny_minimax_h3
from tests.exports import export_lora


@pytest.fixture(scope="module")
def folder(tiny_models) -> Path:
    return make_tiny_minimax_h3(tiny_models / "tiny-minimax_h3")


def _spec(folder: Path, *overrides: str):
    from dpipe.config.compose import compose_run
    from dpipe.models.registry import build_spec

    run = compose_run(["model=tiny_minimax_h3", f"model.path={folder}", "dataset=synthetic",
                       *overrides])
    spec = build_spec(run.model)
    spec.ensure_available()
    return run, spec


def _pipeline(folder: Path):
    """The t2va pipeline with every component as `load_components` loads it, but the processor:
    transformers builds Qwen3VLProcessor only with torchvision (`load_processor`)."""
    from diffusers import ModularPipeline

    from dpipe.models.minimax_h3.processor import load_processor

    pipe = ModularPipeline.from_pretrained(str(folder), workflow="t2va")
    pipe.load_components(names=[n for n in pipe.pretrained_component_names if n != "processor"],
                         dtype=torch.float32)
    pipe.update_components(processor=load_processor(folder / "processor"))
    return pipe


def test_modular_pipeline_generates_with_its_defaults(folder):
    """5 s (the shortest the pipeline makes: 120 frames, rounded up to 17k+5 = 124) of 64x64
    video with its stereo soundtrack, 2 steps, the pipeline's other defaults."""
    pipe = _pipeline(folder)
    out = pipe(prompt="a red circle on a blue background", num_frames=120, height=64, width=64,
               num_inference_steps=2, generator=torch.Generator().manual_seed(0),
               output_type="pt")
    video, audio = out.get("videos"), out.get("audio")
    assert video.shape == (1, 124, 3, 64, 64) and video.std() > 0
    assert audio.shape[:2] == (1, 2) and audio.std() > 0
    assert audio.shape[2] == round(124 / 24 * 40) * 800  # 40 latents/s, an 800-sample hop
    assert out.get("sampling_rate") == 32000


def test_folder_is_laid_out_as_the_release(folder):
    index = json.loads((folder / "modular_model_index.json").read_text())
    assert index["_class_name"] == "MiniMaxH3ModularPipeline"
    for name in ("transformer", "transformer_ref", "vae", "audio_vae", "text_encoder",
                 "tokenizer", "processor", "scheduler", "audio_scheduler"):
        assert index[name][2] == {**index[name][2], "pretrained_model_name_or_path": REPO,
                                  "subfolder": name}
        assert (folder / name).is_dir()
    assert (folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    # The release's mixed precision: input and output projections and the time MLP in fp32.
    dtypes = {}
    for file in (folder / "transformer").glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            dtypes.update({k: f.get_tensor(k).dtype for k in f.keys()})
    assert dtypes["proj_in.weight"] == dtypes["audio_proj_out.bias"] == torch.float32
    assert dtypes["time_embedder.linear_1.weight"] == torch.float32
    assert dtypes["transformer_blocks.0.attn.to_q.weight"] == torch.bfloat16
    text = json.loads((folder / "text_encoder" / "config.json").read_text())["text_config"]
    assert text["num_hidden_layers"] > 50  # hidden_states[50] is read
    assert json.loads((folder / "audio_scheduler" / "scheduler_config.json").read_text())[
        "shift"] == 3.0


def _inputs(spec, folder, audio: bool, g: torch.Generator, weights=None):
    """A micro-batch of 2 samples whose prompts differ in length, through `make_inputs`; with
    model.guidance > 1, an unconditional prompt of 2 tokens beside each; `weights`: one loss
    weight per sample (as a directory's loss_weight gives)."""
    from dpipe.models.spec import NoisedBatch

    latents = torch.randn(2, 8, 2, 4, 4, generator=g)
    noise = torch.randn(latents.shape, generator=g)
    t = torch.tensor([0.3, 0.8])
    noisy, target = spec.noise(latents, noise, t.view(-1, 1, 1, 1, 1))
    text = torch.randn(2, 64, 32, generator=g)
    mask = torch.zeros(2, 64, dtype=torch.long)
    mask[0, :5], mask[1, :9] = 1, 1
    text = {"qwen": text, "qwen_mask": mask}
    if spec.guided:
        text["uncond"] = torch.randn(1, 2, 32, generator=g).expand(2, -1, -1)
        text["uncond_mask"] = torch.ones(2, 2, dtype=torch.long)
    sound = {}
    if audio:
        a = torch.randn(2, 2 * 3, 8, generator=g)
        a_noise = torch.randn(a.shape, generator=g)
        a_noisy, a_target = spec.noise(a, a_noise, t.view(-1, 1, 1))
        sound = dict(audio=a, audio_noise=a_noise, audio_noisy=a_noisy, audio_target=a_target)
    if weights is not None:
        sound["loss_weight"] = torch.tensor(weights).view(2, 1, 1, 1, 1).expand(2, 1, 1, 4, 4)
    batch = NoisedBatch(latents=latents, noise=noise, timesteps=t, noisy=noisy, target=target,
                      text=text, **sound)
    return spec.make_inputs(batch)


@pytest.mark.parametrize("audio", [False, True])
def test_layers_equal_the_diffusers_forward(folder, audio):
    """fp32: the layers, sample by sample, equal the transformer's forward with the pipeline's
    layout; the loss is the video's (plus the audio's) flow-matching loss."""
    _, spec = _spec(folder, f"model.audio={str(audio).lower()}")
    denoiser = spec.load_denoiser(torch.float32)
    inputs, labels = _inputs(spec, folder, audio, torch.Generator().manual_seed(0))
    x = inputs
    with torch.no_grad():
        for layer in spec.pipeline_layers(denoiser):
            x = layer(x)
        expected = spec.denoiser_forward(denoiser, inputs)
    assert x.shape == ((2, 8 * 32 + 6 * 8) if audio else (2, 8, 32))
    torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)
    loss = spec.loss(x, labels)
    assert loss.ndim == 0 and loss > 0
    # prior preservation: the base model's prediction as the targets (both streams) gives loss 0
    assert spec.loss(x, spec.prior_labels(x, labels, [0, 1])) == 0
    assert 0 < spec.loss(x, spec.prior_labels(x, labels, [1])) < loss
    if audio:  # clips without their audio latents are refused, not trained as video only
        with pytest.raises(DataError, match="model.audio=true.*no audio latents"):
            _inputs(spec, folder, False, torch.Generator().manual_seed(0))
    if audio:  # the video rows attend to the audio rows: they change the video's prediction
        from dpipe.models.sync_free import carrier, sizes

        f, h, w, _, _ = sizes(inputs[5])
        video_only = (inputs[0], *inputs[2:5], carrier(f, h, w, 0, 0))
        with torch.no_grad():
            alone = spec.denoiser_forward(denoiser, video_only)
        assert (alone.flatten(1) - x[:, :8 * 32]).abs().max() > 1e-4


def test_a_samples_loss_weight_weighs_its_sound_too(folder):
    """Per-sample weights (a directory's loss_weight, timestep weighting; here 2 and 0.5) weigh
    both the video and the audio rows of their sample."""
    _, spec = _spec(folder, "model.audio=true")
    _, labels = _inputs(spec, folder, True, torch.Generator().manual_seed(4), (2.0, 0.5))
    target, audio_target, _weight = labels
    from dpipe.models.minimax_h3.spec import split_prediction

    outputs = torch.randn(2, target[0].numel() + audio_target[0].numel())
    video, audio = split_prediction(outputs, target.shape, audio_target.shape)
    w = torch.tensor([2.0, 0.5])
    expected = ((w * ((video - target) ** 2).flatten(1).mean(1)).mean()
                + spec.cfg.audio_loss_weight * (w * ((audio - audio_target) ** 2).flatten(1)
                                                .mean(1)).mean())
    torch.testing.assert_close(spec.loss(outputs, labels), expected)


def test_cfg_augmented_training_fits_the_guided_prediction(folder):
    """model.guidance=3: the layers return (cond + 2 uncond) / 3, equal to the diffusers forward
    so combined; the unconditional sequences take no gradient, so the loss's gradient is that of
    cond / 3 against a target that the unconditional prediction moves."""
    from dpipe.models.sync_free import carrier, sizes
    from dpipe.train.trainable import trainable_layers

    run, spec = _spec(folder, "model.guidance=3", "model.audio=true")
    denoiser = spec.load_denoiser(torch.float32)
    layers = trainable_layers(spec, run, denoiser)
    g = torch.Generator().manual_seed(2)
    params = [p for layer in layers for p in layer.parameters() if p.requires_grad]
    for p in params:
        p.data = torch.randn(p.shape, generator=g) * 0.1
    inputs, labels = _inputs(spec, folder, True, g)
    assert inputs[3].shape[0] == 4  # two samples, then the two with the unconditional prompt
    uncond = inputs[3][2:]  # the one 2-token unconditional prompt beside each, not a caption
    assert torch.equal(uncond[0], uncond[1]) and uncond[:, 2:].abs().sum() == 0
    assert not torch.equal(uncond[0, :2], inputs[3][0, :2])
    x = inputs
    for layer in layers:
        x = layer(x)
    spec.loss(x, labels).backward()
    guided = [p.grad.clone() for p in params]
    with torch.no_grad():
        torch.testing.assert_close(x, spec.denoiser_forward(denoiser, inputs),
                                   rtol=1e-4, atol=1e-5)

    # The conditional sequences alone, combined by hand with the unconditional part as a
    # constant: the same gradient.
    for p in params:
        p.grad = None
    f, h, w, n, b = sizes(inputs[5])
    cond = (*inputs[:3], inputs[3][:b], carrier(*sizes(inputs[4])[:b]), carrier(f, h, w, n, 0))
    y = cond
    for layer in layers:
        y = layer(y)
    uncond_part = (x.detach() * 3 - y.detach()) / 3  # (s - 1) uncond / s
    spec.loss(y / 3 + uncond_part, labels).backward()
    assert any(a.abs().max() > 0 for a in guided)
    for a, p in zip(guided, params):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-8)


def test_lora_export_loads_into_diffusers_and_reproduces(folder, tmp_path):
    """Random LoRA weights on every default target: the exported file, loaded by the modular
    pipeline's `load_lora_weights`, gives the transformer that the layers compute."""
    from dpipe.train.trainable import trainable_layers

    run, spec = _spec(folder, "model.lora.rank=2", "model.lora.alpha=3", "model.audio=true")
    layers = trainable_layers(spec, run)
    g = torch.Generator().manual_seed(1)
    state = {}
    for layer in layers:
        for name, p in layer.source_named_parameters():
            if p.requires_grad:
                p.data = torch.randn(p.shape, generator=g) * 0.3
                state[name] = p.data.clone()
    assert any(".adaln_proj.linear.lora_A" in k for k in state)
    from dpipe.models.minimax_h3.spec import COMFYUI_LORA

    assert [p.name for p in export_lora(spec, state, tmp_path)] == [
        "pytorch_lora_weights.safetensors", COMFYUI_LORA]
    with safe_open(tmp_path / COMFYUI_LORA, "pt") as f:
        assert "diffusion_model.blocks.0.attn.qkv_proj.lora_A.weight" in f.keys()
        assert "diffusion_model.blocks.1.mlp.fc1.lora_B.weight" in f.keys()
    inputs, _ = _inputs(spec, folder, True, g)
    loaded = spec.load_denoiser_with_lora(tmp_path)
    comfy = spec.load_denoiser_with_lora(tmp_path, COMFYUI_LORA)  # diffusers' converter reads it
    base = spec.load_denoiser(torch.float32)
    with torch.no_grad():
        x = inputs
        for layer in layers:
            x = layer(tuple(t.float() if t.is_floating_point() else t for t in x))
        ours, theirs = spec.denoiser_forward(loaded, inputs), spec.denoiser_forward(base, inputs)
        from_comfy = spec.denoiser_forward(comfy, inputs)
    torch.testing.assert_close(x, ours, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(from_comfy, ours, rtol=1e-4, atol=1e-5)
    assert (ours - theirs).abs().max() > 1e-3


def test_encoders_follow_the_pipeline(folder):
    """Prompts: the text-encoder step's embeds, padded with their mask; clips of 17k+5 frames
    and images encode, other lengths are refused naming the frame buckets; stereo audio becomes
    the pipeline's channel-major rows."""
    from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds

    _, spec = _spec(folder, "model.audio=true")
    enc = spec.load_encoders(torch.device("cpu"), torch.float32)
    out = spec.encode_prompts(enc, ["a red fox", "a blue circle on a red square"])
    ids = enc.tokenizer("a red fox", add_special_tokens=False)["input_ids"]
    expected = get_qwen3vl_prompt_embeds(enc.text_encoder, enc.processor, ids, {}, 50)[0]
    assert out["qwen"].shape == (2, 64, 32)
    assert out["qwen_mask"][0].sum() == len(ids)
    torch.testing.assert_close(out["qwen"][0, :len(ids)], expected)
    assert out["qwen"][0, len(ids):].abs().sum() == 0
    assert spec.encode_prompts(enc, [""])["qwen_mask"].sum() == 0  # the unused negative prompt
    _, guided = _spec(folder, "model.guidance=3")  # CFG-augmented: the probe beside each caption
    out = guided.encode_prompts(enc, ["a red fox", "a blue circle"])
    probe = guided.encode_prompts_unguided(enc, " ")
    assert out["uncond"].shape == (2, *probe.shape[1:]) and out["uncond_mask"].all()
    torch.testing.assert_close(out["uncond"][1], probe[0])
    assert guided.encoder_fingerprint("text") != spec.encoder_fingerprint("text")
    with pytest.raises(ConfigError, match="model.guidance=0.5.*>= 1"):
        _spec(folder, "model.guidance=0.5")

    g = torch.Generator().manual_seed(0)
    assert spec.encode_images(enc, torch.rand(1, 3, 64, 64, generator=g) * 2 - 1).shape == (
        1, 8, 1, 4, 4)
    assert spec.encode_videos(enc, torch.rand(1, 3, 22, 64, 64, generator=g) * 2 - 1).shape == (
        1, 8, 7, 4, 4)
    with pytest.raises(DataError, match=r"17k\+5 frames.*dataset.frame_buckets"):
        spec.encode_videos(enc, torch.zeros(1, 3, 9, 64, 64))
    # frame_buckets: null chooses the longest 17k+5 clip that the clips hold.
    assert [spec.sampling().clip_frames(n) for n in (4, 21, 22, 40)] == [1, 5, 22, 39]

    assert spec.audio_format().sample_rate == 32000 and spec.audio_format().channels == 2
    wave = torch.rand(1, 2, 2400, generator=g) * 2 - 1
    rows = spec.encode_audio(enc, wave)
    assert rows.shape == (1, 6, 8)
    # 56 frames at 24 fps: 74667 samples, 94 hops padded, the pipeline's round(56 / 24 * 40) = 93
    assert spec.encode_audio(enc, torch.zeros(1, 2, 74667)).shape == (1, 2 * 93, 8)
    left = spec.encode_audio(enc, wave[:, :1].repeat(1, 2, 1))
    torch.testing.assert_close(rows[:, :3], left[:, :3])  # the left channel's latents first


def test_another_familys_folder_is_refused_naming_it(folder, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    with pytest.raises(ModelLoadError, match="WanPipeline folder, not MiniMax H3"):
        _spec(folder, f"model.path={other}")


def test_sampling_through_the_layers_equals_the_pipeline(folder, tmp_path):
    """dpipe's sampler recipe (both streams, both schedules, no guidance), stepped through the
    layers, ends at the pipeline's final video latents and audio rows; the decodes make the
    pipeline's frames and stereo waveform; the written .mp4 holds the 124 frames and a stereo AAC
    track at the audio VAE's rate, as long as the waveform and the clip (within a frame);
    requests the pipeline cannot make are refused."""
    import av

    from dpipe.models.sampling import SampleRequest
    from dpipe.sample import outputs

    _, spec = _spec(folder)
    sampling = spec.sampling()
    request = SampleRequest(index=0, prompt="a red fox", negative_prompt="", seed=3, width=64,
                            height=32 * 2, frames=124)
    assert sampling.check(request) is None
    assert "17k+5" in sampling.check(SampleRequest(0, "a", "", 0, 64, 64, frames=9))
    assert "has no guidance scale for its sound alone" in sampling.check(
        SampleRequest(0, "a", "", 0, 64, 64, frames=124, audio_guidance=5.0))
    from dpipe.config.schema import SampleConfig
    from dpipe.errors import ConfigError
    from dpipe.sample.requests import sample_requests

    with pytest.raises(ConfigError, match="sample.guidance=3.0: minimax_h3 samples without "
                                          "guidance"):
        sample_requests(SampleConfig(prompts=["a"], guidance=3.0, frames=124), spec)
    enc = spec.load_encoders(torch.device("cpu"), torch.float32)
    text = spec.encode_prompts(enc, [request.prompt])
    denoiser = spec.load_denoiser(torch.float32)
    layers = spec.pipeline_layers(denoiser)
    d = sampling.start(request, 3, 1.0, text, None, None, torch.device("cpu"))
    assert d.uncond is None and len(d.timesteps) == 3
    assert sampling.makes_sound()
    with torch.no_grad():
        for t in d.timesteps:
            x = sampling.inputs(d, t, d.text)
            for layer in layers:
                x = layer(x)
            sampling.step(d, t, sampling.prediction(x, d))
        expected = sampling.diffusers_sample(denoiser, request, 3, 1.0)
    torch.testing.assert_close(d.latents, expected, rtol=1e-4, atol=1e-5)
    video, audio = sampling.split(d.latents)
    assert video.shape == (1, 8, 37, 4, 4) and audio.shape == (1, 2 * 207, 8)
    with torch.no_grad():
        frames, (waveform, rate) = sampling.diffusers_media(denoiser, request, 3, 1.0)
    pixels = sampling.decode(sampling.load_vae(torch.device("cpu"), torch.float32), d.latents)
    torch.testing.assert_close((pixels / 2 + 0.5).clamp(0, 1), frames, rtol=1e-4, atol=1e-4)
    decoder = sampling.load_sound_decoder(torch.device("cpu"), torch.float32)
    sound, sound_rate = sampling.decode_sound(decoder, d.latents)
    assert sound_rate == rate == decoder.config.sampling_rate
    torch.testing.assert_close(sound, waveform, rtol=1e-4, atol=1e-5)
    assert sound.shape[0] == 2 and sound.std() > 0

    path = outputs.write_sample(tmp_path, request, pixels, sampling.fps, audio=(sound, rate))
    with av.open(str(path)) as container:
        picture, track = container.streams.video[0], container.streams.audio[0]
        assert picture.frames == 124
        assert (track.codec_context.name, track.rate, track.channels) == ("aac", rate, 2)
        seconds = float(track.duration * track.time_base)
        assert abs(seconds - sound.shape[1] / rate) < 1 / sampling.fps
        assert abs(seconds - 124 / sampling.fps) < 1 / sampling.fps


def test_a_bf16_load_of_a_single_file_keeps_the_fp32_parts_as_from_pretrained(folder, tmp_path):
    """At bf16, the modules the release keeps in float32 keep the file's float32 values (the
    weights here made to hold values bf16 cannot), and the rotary frequencies stay float32 as
    built: every parameter and buffer equals the folder's, as from_pretrained loads it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from dpipe.models.minimax_h3.tiny import write_single_file
    from tests.unit.video_checks import assert_same_tensors

    root = shutil.copytree(folder, tmp_path / "model")
    kept = []
    for shard in sorted((root / "transformer").glob("*.safetensors")):
        state = load_file(shard)
        kept += [k for k, v in state.items() if v.dtype == torch.float32]
        save_file({k: v + 1e-4 if v.dtype == torch.float32 else v for k, v in state.items()},
                  shard, metadata={"format": "pt"})
    assert "proj_in.weight" in kept  # the release's float32 parts
    file = write_single_file(root, tmp_path / "minimax_h3_t2va_tiny.safetensors", "")
    _, spec = _spec(root, f"model.path={file}", f"model.single_file_config={root}")
    _, base = _spec(root)
    ours = spec.load_denoiser(torch.bfloat16)
    assert_same_tensors(ours, base.load_denoiser(torch.bfloat16))
    assert ours.proj_in.weight.dtype == ours.rope.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_single_file_loads_as_diffusers_reads_it_and_exports_in_its_layout(folder, tmp_path,
                                                                          prefix):
    """A single file in the published layout: diffusers' own `from_single_file` and dpipe read
    the same weights (so the key table is diffusers' reading of the release); a full fine-tune
    is written back in the file's layout (its keys and prefix) beside the diffusers folder."""
    from diffusers import MiniMaxH3Transformer3DModel
    from safetensors.torch import load_file, save_file

    from dpipe.models.minimax_h3.tiny import write_single_file

    file = write_single_file(folder, tmp_path / "minimax_h3_t2va_tiny.safetensors", prefix)
    keys = set(load_file(file))
    assert prefix + "blocks.0.attn.qkv_proj.weight" in keys
    assert prefix + "final_layer.video_out.weight" in keys
    _, spec = _spec(folder, f"model.path={file}", f"model.single_file_config={folder}")
    _, base = _spec(folder)
    # ComfyUI tells the model by rope.inv_freq and sizes its buffer from it: the published
    # files hold diffusers' computed frequencies, in fp32.
    rope = load_file(file)[prefix + "rope.inv_freq"]
    assert rope.dtype == torch.float32
    assert torch.equal(rope, base.load_denoiser(torch.float32).rope.inv_freq)
    loaded = spec.load_denoiser(torch.float32).state_dict()
    expected = base.load_denoiser(torch.float32).state_dict()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    if not prefix:  # diffusers reads the files ComfyUI's repo publishes, unprefixed
        theirs = MiniMaxH3Transformer3DModel.from_single_file(
            str(file), config=str(folder), subfolder="transformer",
            torch_dtype=torch.float32).state_dict()
        assert all(torch.equal(theirs[k], expected[k]) for k in expected)

    trained = {k: v + 1 for k, v in expected.items()}
    names = sorted(trained)
    shards = [tmp_path / "stage-0.safetensors", tmp_path / "stage-1.safetensors"]
    save_file({k: trained[k] for k in names[:30]}, shards[0])
    save_file({k: trained[k] for k in names[30:]}, shards[1])
    spec.export_full(shards, tmp_path / "model")
    exported = spec.load_exported_full(tmp_path / "model").state_dict()
    assert all(torch.equal(exported[k], trained[k]) for k in names)
    written = load_file(tmp_path / "model" / file.name)
    assert set(written) == keys
    q, k, v = written[prefix + "blocks.1.attn.qkv_proj.weight"].chunk(3)
    assert torch.equal(k, trained["transformer_blocks.1.attn.to_k.weight"].to(k.dtype))


def test_the_released_size_builds_for_the_benchmark():
    """dpipe-bench --size 33b: the published config builds (meta device) with MiniMax H3's 33B
    parameters, and its random sample packs into rows as the pipeline would."""
    from dpipe.bench.worker import fixed_micro_batches
    from dpipe.config.compose import compose_run
    from dpipe.models.registry import build_spec
    from dpipe.models.spec import model_params

    run = compose_run(["model=minimax_h3", "model.path=/unused", "dataset=synthetic"])
    spec = build_spec(run.model).for_benchmark("33b")
    denoiser = spec.random_denoiser("33b", torch.float32, torch.device("meta"))
    assert 32.5e9 < model_params(denoiser) < 33.5e9
    (inputs, _), = fixed_micro_batches(spec, "33b", 1, 1, seed=0)
    video, t, text = inputs[:3]
    assert video.shape == (1, 7 * 16 * 28, 24 * 4) and t.shape == (1, 2)
    assert text.shape == (1, 120, 5120)  # cut to the prompt
    video_flops = spec.train_flops(denoiser, inputs, full=False)
    assert video_flops > 0
    # with the soundtrack and with CFG-augmented training: its rows, and the unconditional prompt
    run = compose_run(["model=minimax_h3", "model.path=/unused", "dataset=synthetic",
                       "model.audio=true", "model.guidance=3"])
    spec = build_spec(run.model).for_benchmark("33b")
    (inputs, _), = fixed_micro_batches(spec, "33b", 1, 1, seed=0)
    assert inputs[1].shape == (1, 74, 32) and inputs[3].shape[0] == 2  # sound; the uncond prompt
    assert spec.train_flops(denoiser, inputs, full=False) > video_flops
