"""Every family writes its diffusers LoRA file one way (dpipe.models.lora_files): peft names
without the adapter name, the adapter config as diffusers stores it, under the denoiser's
component name, in the file `load_lora_weights` looks for."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from dpipe.models.lora_files import (
    DIFFUSERS_LORA, lora_metadata, lora_scale, peft_to_diffusers, save_diffusers_lora)


def _cfg(rank, alpha=None, targets=None):
    return SimpleNamespace(lora=SimpleNamespace(rank=rank, alpha=alpha, targets=targets))


def test_metadata_defaults_alpha_to_the_rank_and_targets_to_the_family_s():
    assert lora_metadata(_cfg(8), "blocks") == {"r": 8, "lora_alpha": 8, "target_modules": "blocks"}
    given = lora_metadata(_cfg(8, alpha=4, targets=["to_q"]), "blocks")
    assert given == {"r": 8, "lora_alpha": 4, "target_modules": ["to_q"]}
    assert lora_scale(given) == 0.5


@pytest.mark.parametrize("pipeline, component", [("FluxPipeline", "transformer"),
                                                 ("StableDiffusionXLPipeline", "unet")])
def test_the_file_holds_the_component_s_weights_and_adapter_config(tmp_path, pipeline, component):
    import diffusers

    peft = {"blocks.0.to_q.lora_A.default.weight": torch.randn(4, 16),
            "blocks.0.to_q.lora_B.default.weight": torch.zeros(16, 4)}
    weights = peft_to_diffusers(peft)
    assert sorted(weights) == ["blocks.0.to_q.lora_A.weight", "blocks.0.to_q.lora_B.weight"]
    metadata = lora_metadata(_cfg(4, alpha=2), "blocks")
    written = save_diffusers_lora(getattr(diffusers, pipeline), weights, metadata, tmp_path,
                                  component=component)
    assert written == tmp_path / DIFFUSERS_LORA
    with safe_open(written, "pt") as f:
        assert sorted(f.keys()) == [f"{component}.{k}" for k in sorted(weights)]
        torch.testing.assert_close(f.get_tensor(f"{component}.blocks.0.to_q.lora_A.weight"),
                                   peft["blocks.0.to_q.lora_A.default.weight"])
        stored = json.loads(f.metadata()["lora_adapter_metadata"])
    assert stored == {f"{component}.r": 4, f"{component}.lora_alpha": 2,
                      f"{component}.target_modules": "blocks"}
