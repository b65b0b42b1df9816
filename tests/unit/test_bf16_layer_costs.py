"""A bf16 run's layer costs: `counted_layer_flops` feeds the layers inputs in their own dtype.

SDXL counts its layers' FLOPs on the layers themselves (dpipe.models.sdxl.costs); with
`train.precision=bf16` their frozen weights are bf16, and a conv refuses fp32 inputs outside
autocast: `dpipe-train model=sdxl ... train.precision=bf16` (docs/models/sdxl.md) failed before
its first step."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from dpipe.models.sdxl.costs import nominal_inputs
from dpipe.models.sdxl.tiny import make_tiny_sdxl
from dpipe.models.spec import counted_layer_flops
from tests.unit.test_tiny_sdxl import _spec


def test_bf16_layers_cost_what_fp32_layers_do(tmp_path):
    spec = _spec(make_tiny_sdxl(tmp_path / "sdxl"))
    inputs = nominal_inputs(spec._unet_config_dict(), spec._vae_scale(), torch.device("cpu"), 64)
    fp32, bf16 = (counted_layer_flops(spec.pipeline_layers(spec.load_denoiser(dtype)), inputs)
                  for dtype in (torch.float32, torch.bfloat16))
    assert bf16 == fp32 and all(f > 0 for f in fp32)
