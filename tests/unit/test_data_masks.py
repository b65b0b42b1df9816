"""Masks weight the loss per pixel: cached with the image's crop, pooled to latent resolution,
delivered in the labels, and applied by the model's loss. Control images ride along."""

from __future__ import annotations

import torch
from PIL import Image

from dpipe.config.schema import TimestepConfig
from dpipe.data.batches import noised_batch, step_micro_batches
from dpipe.data.prepare import Layout, prepare
from tests.unit.test_data_support import FakeSpec, dataset_config, tiny_flux_spec, write_image


def _masked_dataset(tmp_path, spec, control=False):
    data, masks = tmp_path / "data", tmp_path / "data" / "masks"
    for i in range(2):
        write_image(data / f"{i}.png", (64, 32), seed=i)
    masks.mkdir(parents=True)
    # Left half white (weight 1), right half black (weight 0), in the 64 x 32 source.
    left = Image.new("L", (64, 32), 0)
    left.paste(255, (0, 0, 32, 32))
    left.save(masks / "0.png")
    Image.new("L", (64, 32), 255).save(masks / "1.jpg")
    extra = {}
    if control:
        for i in range(2):
            write_image(tmp_path / "controls" / f"{i}.png", (64, 32), seed=10 + i, caption=None)
        extra["control_dir"] = str(tmp_path / "controls")
    # The mask folder inside the data folder is not data: it is excluded from the walk.
    cfg = dataset_config(path=str(data), cache_dir=str(tmp_path / "cache"), resolutions=[32],
                         aspect_ratios=[2.0], mask_dir="masks", **extra)
    return prepare(spec, cfg, torch.device("cpu"), torch.float32, Layout(2, 1, 1, 0))


def test_masks_become_latent_resolution_weights(tmp_path):
    dataset = _masked_dataset(tmp_path, FakeSpec())
    (bucket,) = dataset.plan.manifest.buckets
    assert bucket.name == "48x24" and len(bucket.samples) == 2  # the masks are not samples
    by_name = {s.source.rsplit("/", 1)[-1]: s for s in bucket.samples}
    latents, _, weight, control = dataset.collate([by_name["0.png"], by_name["1.png"]],
                                                  [by_name["0.png"].texts[0]] * 2)
    assert latents.shape == (2, 4, 6, 12) and weight.shape == (2, 1, 6, 12) and control is None
    assert torch.equal(weight[1], torch.ones(1, 6, 12))
    assert torch.allclose(weight[0, 0, :, :5], torch.ones(6, 5), atol=0.02)
    assert torch.allclose(weight[0, 0, :, 7:], torch.zeros(6, 5), atol=0.02)


def test_control_images_are_cached_and_delivered(tmp_path):
    dataset = _masked_dataset(tmp_path, FakeSpec(), control=True)
    samples = dataset.plan.manifest.buckets[0].samples
    latents, _, _, control = dataset.collate(samples, [s.texts[0] for s in samples])
    assert control is not None and control.shape == latents.shape
    assert not torch.equal(control, latents)


def test_flux_loss_applies_the_weights(tmp_path):
    spec = tiny_flux_spec()
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 4, 8, 12, generator=gen)
    text = {"t5": torch.randn(2, 32, 32, generator=gen), "pooled": torch.randn(2, 32, generator=gen)}
    weight = torch.rand(2, 1, 8, 12, generator=gen)
    plain = noised_batch(spec, latents, text, TimestepConfig(), 0, 0, range(2))
    masked = noised_batch(spec, latents, text, TimestepConfig(), 0, 0, range(2), loss_weight=weight)
    _, plain_labels = spec.make_inputs(plain)
    _, labels = spec.make_inputs(masked)
    assert len(plain_labels) == 1 and len(labels) == 2
    outputs = torch.randn_like(labels[0])
    # The weights line up with the packed target element by element.
    unpacked = torch.stack([_unpack(labels[1], 8, 12, 4), _unpack(labels[0], 8, 12, 4)])
    assert torch.equal(unpacked[0], weight.expand(2, 4, 8, 12))
    expected = (unpacked[0] * (_unpack(outputs, 8, 12, 4) - unpacked[1]) ** 2).mean()
    torch.testing.assert_close(spec.loss(outputs, labels), expected)
    ones = spec.make_inputs(noised_batch(spec, latents, text, TimestepConfig(), 0, 0, range(2),
                                         loss_weight=torch.ones(2, 1, 8, 12)))[1]
    torch.testing.assert_close(spec.loss(outputs, ones), spec.loss(outputs, plain_labels))


def test_flux_trains_on_masked_buckets(tmp_path):
    spec = tiny_flux_spec()
    dataset = _masked_dataset(tmp_path, spec)
    (inputs, labels), = list(step_micro_batches(spec, dataset, dataset.plan, TimestepConfig(),
                                                0, 0, 0))
    # 48x24 pixels -> 4 x 6 x 12 latents (tiny VAE: 4x) -> 18 tokens of 2x2x4 channels.
    assert labels[0].shape == labels[1].shape == (2, 18, 16)
    assert labels[1].min() >= 0 and labels[1].max() <= 1 and labels[1].min() < 0.5


def _unpack(packed: torch.Tensor, h: int, w: int, c: int) -> torch.Tensor:
    b = packed.shape[0]
    x = packed.view(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)
