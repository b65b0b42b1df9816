"""The tiny SDXL: loads with diffusers from its folder and from its single file (same weights);
pipeline layers with skip connections reproduce the UNet; DDPM objective; kohya LoRA keys."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import re
from pathlib import Path

import pytest
import torch
from diffusers import DDPMScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

from dpipe.config.schema import LoraConfig, ModelConfig
from dpipe.errors import ConfigError
from dpipe.models.sdxl import ddpm
from dpipe.models.sdxl.spec import KOHYA_FILE, LORA_TARGETS, SDXLSpec
from dpipe.models.sdxl.tiny import SINGLE_FILE
from dpipe.models.spec import NoisedBatch
from dpipe.train.lora import make_trainable
from tests.exports import export_lora

CAPTION = "a red circle on a blue background"


@pytest.fixture(scope="module")
def pipe(tiny) -> StableDiffusionXLPipeline:
    return StableDiffusionXLPipeline.from_pretrained(tiny, dtype=torch.float32)


def _spec(path, **kw) -> SDXLSpec:
    return SDXLSpec(ModelConfig(family="sdxl", path=str(path), lora=LoraConfig(rank=4, alpha=2),
                                **kw))


def test_layout(tiny, pipe):
    assert pipe.tokenizer_2.pad_token == "!" and pipe.tokenizer.pad_token == "<|endoftext|>"
    assert pipe.scheduler.config.prediction_type == "epsilon"
    assert pipe.scheduler.config.beta_schedule == "scaled_linear"
    assert (tiny / SINGLE_FILE).is_file()
    # Width tells diffusers' single-file loader the two CLIPs apart, as 768 vs 1280 does.
    assert pipe.text_encoder.config.hidden_size != pipe.text_encoder_2.config.hidden_size


def test_single_file_gives_the_folder_weights(tiny, pipe):
    single = StableDiffusionXLPipeline.from_single_file(
        str(tiny / SINGLE_FILE), config=str(tiny), torch_dtype=torch.float32)
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        a, b = getattr(pipe, name).state_dict(), getattr(single, name).state_dict()
        assert a.keys() == b.keys(), name
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_spec_loads_the_single_file(tiny, pipe):
    spec = _spec(tiny / SINGLE_FILE, single_file_config=str(tiny))
    spec.ensure_available()
    assert spec.single_file and spec.pixel_multiple == 16
    unet = spec.load_denoiser(torch.float32)
    ref = pipe.unet.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in unet.state_dict().items())
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    a = spec.encode_prompts(encoders, [CAPTION])
    b = _spec(tiny).encode_prompts(pipe, [CAPTION])
    assert a.keys() == {"text", "pooled"} and all(torch.equal(a[k], b[k]) for k in a)
    assert spec.encoder_fingerprint("text") != _spec(tiny).encoder_fingerprint("text")


def test_config_errors(tiny):
    with pytest.raises(ConfigError, match="prediction_type"):
        _spec(tiny, prediction_type="flow")
    with pytest.raises(ConfigError, match="single_file_config"):
        _spec(tiny, single_file_config=str(tiny))
    with pytest.raises(ConfigError, match="min_snr_gamma"):
        _spec(tiny, min_snr_gamma=-1.0)


@pytest.mark.parametrize("latent", [16, 10])  # 10: not a multiple of 4, diffusers' odd-size path
def test_layers_reproduce_the_unet_with_lora(tiny, latent):
    spec = _spec(tiny)
    unet = spec.load_denoiser(torch.float32)
    make_trainable(unet, spec.cfg, spec.lora_targets())
    for name, p in unet.named_parameters():  # non-zero LoRA B: the adapters change the output
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 4, latent, latent, generator=gen)
    noise = torch.randn(x0.shape, generator=gen)
    t = torch.tensor([0.1, 0.9])
    noisy, target = spec.noise(x0, noise, t)
    text = {"text": torch.randn(2, 77, 80, generator=gen), "pooled": torch.randn(2, 48, generator=gen)}
    inputs, labels = spec.make_inputs(NoisedBatch(x0, noise, t, noisy, target, text))
    x = inputs
    for layer in spec.pipeline_layers(unet):
        x = layer(x)
        # DeepSpeed sends stage outputs as they are: they must be contiguous.
        assert all(t.is_contiguous() for t in (x if isinstance(x, tuple) else (x,)))
    with torch.no_grad():
        expected = spec.denoiser_forward(unet, inputs)
    torch.testing.assert_close(x, expected, rtol=0, atol=0)
    spec.loss(x, labels).backward()
    grads = [p.grad for n, p in unet.named_parameters() if "lora_" in n]
    assert grads and all(g is not None for g in grads)
    assert inputs[4].tolist() == [[latent * 4, latent * 4, 0, 0, latent * 4, latent * 4]] * 2


def test_lora_targets_are_the_transformer_linears(pipe):
    pattern = re.compile(LORA_TARGETS)
    linears = {n for n, m in pipe.unet.named_modules() if isinstance(m, torch.nn.Linear)}
    in_attn = {n for n in linears if ".attentions." in n}
    assert in_attn and all(pattern.fullmatch(n) for n in in_attn)
    assert not any(pattern.fullmatch(n) for n in linears - in_attn)  # resnets' time_emb_proj, ...


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_objective_matches_diffusers(tiny, prediction):
    spec = _spec(tiny, prediction_type=prediction)
    scheduler = DDPMScheduler.from_pretrained(tiny, subfolder="scheduler")
    x0, noise = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)
    t = torch.tensor([0.0, 0.5, 0.9999])
    steps = torch.tensor([0, 500, 999])
    noisy, target = spec.noise(x0, noise, t)
    torch.testing.assert_close(noisy, scheduler.add_noise(x0, noise, steps))
    expected = noise if prediction == "epsilon" else scheduler.get_velocity(x0, noise, steps)
    torch.testing.assert_close(target, expected)


def test_min_snr_weights(tiny):
    abar = torch.tensor([0.99, 0.5, 0.01])
    snr = abar / (1 - abar)  # 99, 1, 0.0101
    eps = ddpm.loss_weights(abar, "epsilon", 5.0)
    torch.testing.assert_close(eps, torch.minimum(snr, torch.tensor(5.0)) / snr)
    assert eps[1] == 1 and eps[0] == pytest.approx(5 / 99)
    v = ddpm.loss_weights(abar, "v_prediction", 5.0)
    torch.testing.assert_close(v, torch.minimum(snr, torch.tensor(5.0)) / (snr + 1))
    assert torch.equal(ddpm.loss_weights(abar, "epsilon", 0.0), torch.ones(3))
    # The weights reach the loss per sample.
    spec = _spec(tiny, min_snr_gamma=5.0)
    out, target = torch.zeros(2, 1, 2, 2), torch.ones(2, 1, 2, 2)
    assert spec.loss(out, (target, torch.tensor([1.0, 0.0]))).item() == pytest.approx(0.5)


@pytest.mark.slow
def test_kohya_lora_loads_like_the_diffusers_file(tiny, pipe, tmp_path):
    spec = _spec(tiny)
    unet = spec.load_denoiser(torch.float32)
    make_trainable(unet, spec.cfg, spec.lora_targets())
    gen = torch.Generator().manual_seed(1)
    lora = {n: torch.randn(p.shape, generator=gen) * 0.05
            for n, p in unet.named_parameters() if "lora_" in n}
    paths = export_lora(spec, lora, tmp_path)
    assert [p.name for p in paths] == ["pytorch_lora_weights.safetensors", KOHYA_FILE]
    from safetensors.torch import load_file

    keys = load_file(tmp_path / KOHYA_FILE)
    assert "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight" in keys
    assert "lora_unet_middle_block_1_proj_in.alpha" in keys
    assert "lora_unet_output_blocks_0_1_transformer_blocks_1_ff_net_2.lora_up.weight" in keys

    inputs = (torch.randn(1, 4, 16, 16), torch.tensor([300]), torch.randn(1, 77, 80),
              torch.randn(1, 48), torch.tensor([[64.0, 64, 0, 0, 64, 64]]))
    outputs = []
    for weight_name in ("pytorch_lora_weights.safetensors", KOHYA_FILE):
        p = StableDiffusionXLPipeline.from_pretrained(
            tiny, vae=None, text_encoder=None, text_encoder_2=None, tokenizer=None,
            tokenizer_2=None)
        p.load_lora_weights(str(tmp_path), weight_name=weight_name)
        with torch.no_grad():
            outputs.append(spec.denoiser_forward(p.unet, inputs))
    with torch.no_grad():
        base = spec.denoiser_forward(pipe.unet, inputs)
    assert (outputs[0] - base).abs().max() > 1e-4
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_exported_config_roundtrip(tiny, tmp_path):
    """A full export from a single-file base writes a UNet folder `from_pretrained` loads."""
    from safetensors.torch import save_file

    spec = _spec(tiny / SINGLE_FILE, single_file_config=str(tiny))
    unet = spec.load_denoiser(torch.float32)
    shard = tmp_path / "stage-000.safetensors"
    save_file({k: v.contiguous() for k, v in unet.state_dict().items()}, shard)
    out = spec.export_full([shard], tmp_path / "export")
    again = UNet2DConditionModel.from_pretrained(out)
    assert all(torch.equal(v, unet.state_dict()[k]) for k, v in again.state_dict().items())


def test_size_and_crop_ids_come_from_the_data(tiny, tmp_path):
    """SDXL's add_time_ids are (original h, w, crop top, left, target h, w) as diffusers' SDXL
    training script makes them: the file's size, and the offset of the crop that fitted it to
    its bucket in the file scaled to cover the bucket."""
    from dpipe.config.schema import TimestepConfig
    from dpipe.data.batches import step_micro_batches
    from dpipe.data.prepare import Layout, prepare
    from tests.unit.test_data_support import dataset_config, write_image

    write_image(tmp_path / "data" / "wide.png", (96, 64), seed=1)  # 96x64 -> cut 16 px left
    write_image(tmp_path / "data" / "tall.png", (40, 60), seed=2)  # 64x96 -> cut 16 px top
    cfg = dataset_config(path=str(tmp_path / "data"), cache_dir=str(tmp_path / "cache"),
                         resolutions=[64], aspect_ratios=[1.0])
    spec = _spec(tiny)
    dataset = prepare(spec, cfg, torch.device("cpu"), torch.float32, Layout(2, 1, 1, 0))
    batch = dataset.plan.micro_batch(0, 0, 0)
    inputs, _ = next(step_micro_batches(spec, dataset, dataset.plan, TimestepConfig(), 0, 0, 0))
    time_ids = {Path(s.source).name: row.tolist() for s, row in zip(batch.samples, inputs[4])}
    assert time_ids == {"wide.png": [64, 96, 0, 16, 64, 64], "tall.png": [60, 40, 16, 0, 64, 64]}
    # The cached latent records the same, in its metadata.
    wide = next(s for s in batch.samples if s.source.endswith("wide.png"))
    meta = dataset.store.metadata(wide.latent)
    assert (meta["original_size"], meta["crop_top_left"]) == ("64,96", "0,16")
    # A batch made without a dataset: the trained size, uncropped.
    latents = dataset.store.get(wide.latent)["latents"][None]  # 64x64 pixels
    b = NoisedBatch(latents, latents, torch.full((1,), 0.5), latents, latents,
                    {"text": torch.zeros(1, 77, 64), "pooled": torch.zeros(1, 32)})
    assert spec.make_inputs(b)[0][4].tolist() == [[64, 64, 0, 0, 64, 64]]
