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
    from dpipe.data.batches import step_micro_batches
    from dpipe.models.flux.tiny import make_tiny_flux, write_bfl_single_file
    from tests.cli import dpipe_train, train_args
    from tests.integration.trained import cached_dataset, run_config, run_layers, trained_layers

    folder = make_tiny_flux(tmp_path / "tiny-flux")
    file = write_bfl_single_file(folder, tmp_path / "flux1-dev.safetensors",
                                 prefix="model.diffusion_model.")
    run_dir = tmp_path / "run"
    result = dpipe_train(*train_args(
        run_dir, "model=tiny_flux", f"model.path={file}", "model.tiny=false",
        f"model.single_file_config={folder}", "dataset=synthetic", "pipeline.stages=2",
        "pipeline.micro_batches=2", "optim.lr=1e-3", "train.checkpoint_every_steps=0",
        "train.max_steps=2"))
    assert result.code == 0, f"dpipe-train failed ({result.code}):\n{result.out}\n{result.err}"
    spec, layers = trained_layers(run_dir)
    assert spec.single_file == file and spec.path == folder
    from diffusers import FluxTransformer2DModel

    frozen = {}
    for layer in layers:
        frozen.update({k.replace(".base_layer", ""): v for k, v in
                       layer.denoiser_state_dict(trainable_only=False).items() if "lora_" not in k})
    folder_weights = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer").state_dict()
    assert frozen.keys() == folder_weights.keys()
    for name, value in folder_weights.items():  # the base weights are the file's = the folder's
        assert torch.equal(frozen[name].float(), value.float()), name

    dataset, plan = cached_dataset(run_dir)
    inputs, _ = next(step_micro_batches(spec, dataset, plan, run_config(run_dir).train.timesteps,
                                        1, 0, 0))
    with torch.no_grad():
        got = spec.denoiser_forward(spec.load_denoiser_with_lora(run_dir / "lora"), inputs)
    torch.testing.assert_close(got, run_layers(layers, inputs), rtol=1e-4, atol=1e-5)
    comfy = load_file(run_dir / "lora" / "flux_lora_comfyui.safetensors")
    assert "diffusion_model.single_blocks.0.linear1.lora_A.weight" in comfy
