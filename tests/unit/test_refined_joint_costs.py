"""The stage-balancing costs of Z-Image and Lumina 2 (dpipe.models.refined_joint): the forward
FLOPs each pipeline layer runs, as torch's FlopCounterMode counts them on the tiny models, where
parameter counts put a caption refiner, which runs over a few tokens, at a block's weight."""

import os

# Before any Hugging Face import: a hub lookup offline would stall ~48 s on retries.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dpipe.models.refined_joint import layer_forward_flops
from dpipe.models.spec import ModelSpec
from dpipe.models.spec import counted_layer_flops

CAPTIONS = ["a red circle on a blue background", "a cat"]


def _family(name):
    if name == "z_image":
        import dpipe.models.z_image.spec as module
        import tests.unit.test_tiny_z_image as tests
        from dpipe.models.z_image.tiny import make_tiny_z_image as make
    else:  # the weights' names are those of Lumina-Image 2.0's transformer design
        import dpipe.models.common.lumina as module
        import tests.unit.test_tiny_lumina2 as tests
        from dpipe.models.lumina2.tiny import make_tiny_lumina2 as make
    return module, tests, make


@pytest.fixture(scope="module", params=["z_image", "lumina2"])
def family(request, tmp_path_factory):
    module, tests, make = _family(request.param)
    spec = tests._spec(make(tmp_path_factory.mktemp("models") / request.param))
    encoders = spec.load_encoders(torch.device("cpu"), torch.float32)
    layers = spec.pipeline_layers(spec.load_denoiser(torch.float32))
    return module, spec, layers, tests._inputs(spec, encoders, CAPTIONS)[0]


def _tokens(layers, inputs):
    """(image, text) tokens as the layers get them: Z-Image pads each stream to 32."""
    with torch.no_grad():
        x, cap = layers[0](inputs)[:2]
    return x.shape[1], cap.shape[1]


def test_modelled_flops_are_what_each_layer_runs(family):
    module, _, layers, inputs = family
    with sdpa_kernel(SDPBackend.MATH):  # attention as matmuls, which the counter counts
        counted = [flops / inputs[0].shape[0]
                   for flops in counted_layer_flops(layers, inputs, fake=False)]
    modelled = layer_forward_flops(layers, *_tokens(layers, inputs),
                                   module.PER_SAMPLE_WEIGHTS, module.TEXT_WEIGHTS)
    assert modelled == pytest.approx(counted, rel=1e-6)


def test_caption_refiners_cost_less_than_blocks_where_parameters_say_alike(family):
    _, spec, layers, _ = family
    costs, params = spec.layer_costs(layers), ModelSpec.layer_costs(spec, layers)
    caption = [i for i, layer in enumerate(layers) if getattr(layer, "stream", "") == "caption"]
    image = [i for i, layer in enumerate(layers) if getattr(layer, "stream", "") == "image"]
    blocks = [i for i, layer in enumerate(layers) if type(layer).__name__.endswith("Block")]
    assert caption and image and blocks
    # At the nominal 1024x1024 image: the caption's few tokens, the image's most of them.
    assert max(costs[i] for i in caption) < 0.2 * min(costs[i] for i in blocks)
    assert max(costs[i] for i in blocks) > max(costs[i] for i in image) > 0.5 * costs[blocks[0]]
    # Parameter counts weigh a caption refiner as most of a block.
    assert min(params[i] for i in caption) > 0.5 * max(params[i] for i in blocks)
