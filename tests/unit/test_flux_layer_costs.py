"""FLUX's layer costs against the layer times measured on an H200 (`python -m dpipe.bench.layers`,
docs/bench-results/h200-1gpu-stage): the split they give is as fast as the best split by the
measured times."""

from __future__ import annotations

import json

import pytest
import torch

from dpipe.config.compose import compose_run
from dpipe.models.registry import build_spec
from dpipe.bench.layers import best_splits
from tests.cli import REPO

MEASURED = REPO / "docs" / "bench-results" / "h200-1gpu-stage"


@pytest.mark.parametrize("mode,extra", [("full", ["optim.master_weights=false"]),
                                        ("lora", ["model.lora.rank=32"])])
@pytest.mark.parametrize("stages", [2, 4])
def test_balanced_split_of_flux_dev_evens_out_measured_stage_times(mode, extra, stages):
    from diffusers import FluxTransformer2DModel

    from dpipe.models.flux.sizes import SIZES

    run = compose_run(["model=flux", "model.path=/unused", f"model.mode={mode}", *extra])
    spec = build_spec(run.model)
    with torch.device("meta"):
        layers = spec.pipeline_layers(FluxTransformer2DModel.from_config(SIZES["dev"]))
    measured = json.loads((MEASURED / f"call1-layers-{mode}.json").read_text())["layers"]
    assert len(measured) == len(layers)
    times = [r["forward_ms"] + r["backward_ms"] for r in measured]
    # The slowest stage of the spec's split is within 2% of the best split by the measured times
    # (one layer is ~7% of a quarter of the model, so stages cannot all be equal).
    split = best_splits(times, spec.layer_costs(layers))[stages]
    assert split["spec_ms"] <= 1.02 * split["measured_ms"], split
