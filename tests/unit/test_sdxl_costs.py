"""SDXL's stage-balancing costs (dpipe.models.sdxl.costs): each pipeline layer's forward FLOPs
at 1024x1024, counted on fake tensors, which is what the layer runs on real ones; parameter
counts put the UNet's full-resolution layers far below their work."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from dpipe.models.sdxl.costs import nominal_inputs
from dpipe.models.sdxl.layers import SDXLDown, SDXLUp
from dpipe.models.sdxl.tiny import make_tiny_sdxl
from dpipe.models.spec import ModelSpec, counted_layer_flops
from tests.unit.test_tiny_sdxl import _spec


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    spec = _spec(make_tiny_sdxl(tmp_path_factory.mktemp("models") / "sdxl"))
    return spec, spec.pipeline_layers(spec.load_denoiser(torch.float32))


def test_fake_tensors_count_what_the_layers_run(sdxl):
    """At 64 px (at 1024 the tiny model's math attention would hold GBs)."""
    spec, layers = sdxl
    inputs = nominal_inputs(spec._unet_config_dict(), spec._vae_scale(), torch.device("cpu"), 64)
    real = counted_layer_flops(layers, inputs, fake=False)
    assert counted_layer_flops(layers, inputs) == real and all(f > 0 for f in real)


@pytest.mark.slow
def test_the_costs_are_the_flops_at_1024(sdxl):
    spec, layers = sdxl
    inputs = nominal_inputs(spec._unet_config_dict(), spec._vae_scale(), torch.device("cpu"))
    side = 1024 // spec._vae_scale()  # the tiny VAE downsamples 4x, SDXL's 8x
    assert inputs[0].shape[-2:] == (side, side) and inputs[2].shape[1] == 77
    assert spec.layer_costs(layers) == counted_layer_flops(layers, inputs)


def test_full_resolution_layers_cost_more_per_parameter(sdxl):
    """The first down unit (a resnet at the full latent size) against the last down unit with
    attention (at a quarter of the side): each of the first one's weights does more work."""
    spec, layers = sdxl
    costs, params = spec.layer_costs(layers), ModelSpec.layer_costs(spec, layers)
    downs = [i for i, layer in enumerate(layers)
             if isinstance(layer, SDXLDown) and layer.downsampler is None]
    first, deepest = downs[0], downs[-1]
    assert costs[first] / params[first] > 2 * costs[deepest] / params[deepest]
    assert all(c > 0 for c in costs) and any(isinstance(layer, SDXLUp) for layer in layers)
