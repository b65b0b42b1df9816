"""Training FLUX.1 from a single-file transformer in ComfyUI's layout (BFL names under
`model.diffusion_model.`), with the VAE and text encoders from the diffusers folder."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file


@pytest.mark.slow
def test_trains_from_a_comfyui_single_file_transformer(tmp_path):
    """2 stages from `flux1-dev.safetensors`-style weights: the run starts from exactly the
    file's weights, and its exported LoRA, loaded into a pipeline whose transformer comes from
    that file, reproduces the trained model; the ComfyUI LoRA is written next to it."""
    from dpipe.models.flux.tiny import make_tiny_flux, write_bfl_single_file
    from tests.integration.trained import exported_lora_and_trained, train_lora_from_single_file

    folder = make_tiny_flux(tmp_path / "tiny-flux")
    file = write_bfl_single_file(folder, tmp_path / "flux1-dev.safetensors",
                                 prefix="model.diffusion_model.")
    run_dir = tmp_path / "run"
    spec, layers = train_lora_from_single_file(run_dir, "tiny_flux", file, folder)
    from diffusers import FluxTransformer2DModel

    frozen = {}
    for layer in layers:
        frozen.update({k.replace(".base_layer", ""): v for k, v in
                       layer.denoiser_state_dict(trainable_only=False).items() if "lora_" not in k})
    folder_weights = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer").state_dict()
    assert frozen.keys() == folder_weights.keys()
    for name, value in folder_weights.items():  # the base weights are the file's = the folder's
        assert torch.equal(frozen[name].float(), value.float()), name

    _, got, want = exported_lora_and_trained(run_dir, spec, layers)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    comfy = load_file(run_dir / "lora" / "flux_lora_comfyui.safetensors")
    assert "diffusion_model.single_blocks.0.linear1.lora_A.weight" in comfy
