"""Training FLUX.1 from a single-file transformer in ComfyUI's layout (BFL names under
`model.diffusion_model.`), with the VAE and text encoders from the diffusers folder."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file


@pytest.mark.slow
def test_trains_from_a_comfyui_single_file_transformer_and_its_gguf(tmp_path):
    """2 stages from `flux1-dev.safetensors`-style weights: the run starts from exactly the
    file's weights, and its exported LoRA, loaded into a pipeline whose transformer comes from
    that file, reproduces the trained model; the ComfyUI LoRA is written next to it.

    In the same sweep, the same weights as a Q8_0 GGUF (city96's layout): the run keeps its
    Linears in their blocks (swapping one layer's to the host and back, recomputing every layer),
    its first loss is the one the GGUF's values dequantized by the `gguf` package into a plain
    file give (multiplied in fp32), and its losses are near the plain file's (Q8_0 rounds each
    weight by at most half a step of its 32-value block)."""
    from diffusers import FluxTransformer2DModel

    from dpipe.models.common.gguf_files import gguf_linear_class, write_gguf_copy
    from dpipe.models.flux.tiny import make_tiny_flux, write_bfl_single_file
    from tests.cli import Sweep, metrics
    from tests.integration.trained import (
        exported_lora_and_trained, one_process_first_loss, trained_layers)
    from tests.unit.test_gguf_files import dequantized_copy

    folder = make_tiny_flux(tmp_path / "tiny-flux")
    file = write_bfl_single_file(folder, tmp_path / "flux1-dev.safetensors",
                                 prefix="model.diffusion_model.")
    gguf = write_gguf_copy(file, tmp_path / "flux1-dev-Q8_0.gguf", "Q8_0", "flux")
    dequantized = dequantized_copy(gguf, tmp_path / "flux1-dev-Q8_0-dequantized.safetensors")
    sweep = Sweep(tmp_path / "sweep", "model=tiny_flux", f"model.path={file},{gguf}",
                  "model.tiny=false", f"model.single_file_config={folder}", "dataset=synthetic",
                  "pipeline.stages=2", "pipeline.micro_batches=2", "optim.lr=1e-3",
                  "train.checkpoint_every_steps=0", "train.max_steps=2",
                  "train.progress_bar=false", "pipeline.activation_checkpointing=all",
                  "pipeline.blocks_to_swap=1", timeout=600)
    runs = {name: sweep.run_dir(f"model.path={path}")
            for name, path in (("plain", file), ("gguf", gguf))}

    spec, layers = trained_layers(runs["plain"])
    assert spec.single_file == file and spec.path == folder
    frozen = {}
    for layer in layers:
        frozen.update({k.replace(".base_layer", ""): v for k, v in
                       layer.denoiser_state_dict(trainable_only=False).items() if "lora_" not in k})
    folder_weights = FluxTransformer2DModel.from_pretrained(folder, subfolder="transformer").state_dict()
    assert frozen.keys() == folder_weights.keys()
    for name, value in folder_weights.items():  # the base weights are the file's = the folder's
        assert torch.equal(frozen[name].float(), value.float()), name

    _, got, want = exported_lora_and_trained(runs["plain"], spec, layers)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    comfy = load_file(runs["plain"] / "lora" / "flux_lora_comfyui.safetensors")
    assert "diffusion_model.single_blocks.0.linear1.lora_A.weight" in comfy

    # The GGUF run: its base held in Q8_0 blocks, its exported LoRA reproducing it over the GGUF.
    spec, layers = trained_layers(runs["gguf"])
    kept = [m for layer in layers for m in layer.modules() if isinstance(m, gguf_linear_class())]
    assert len(kept) >= 20 and all(m.weight.dtype == torch.uint8 for m in kept)
    assert "Linears kept quantized (Q8_0)" in (runs["gguf"] / "train.log").read_text()
    _, got, want = exported_lora_and_trained(runs["gguf"], spec, layers)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    losses = {name: torch.tensor([m["loss"] for m in metrics(run)]) for name, run in runs.items()}
    assert losses["gguf"][0].item() == pytest.approx(
        one_process_first_loss(runs["gguf"], model_path=dequantized), rel=1e-5, abs=1e-7)
    assert not torch.equal(losses["gguf"], losses["plain"])  # the weights were rounded
    torch.testing.assert_close(losses["gguf"], losses["plain"], rtol=1e-2, atol=0)


@pytest.mark.slow
def test_trains_from_a_comfyui_fp8_scaled_single_file(tmp_path):
    """2 stages from a ComfyUI fp8_scaled file (the `scaled_fp8` marker, e4m3 weights, a
    `scale_weight` per tensor): the run's base weights are the file's fp8 values times their
    scales, and its exported LoRA, loaded by FluxPipeline onto the transformer read from that
    file, reproduces the trained model."""
    import json

    from dpipe.models.common.bfl_layout import flux1_layout, from_bfl
    from dpipe.models.common.quantized_files import write_quantized_copy
    from dpipe.models.flux.tiny import make_tiny_flux, write_bfl_single_file
    from tests.integration.trained import exported_lora_and_trained, train_lora_from_single_file

    folder = make_tiny_flux(tmp_path / "tiny-flux")
    plain = write_bfl_single_file(folder, tmp_path / "plain.safetensors",
                                  prefix="model.diffusion_model.")
    file = write_quantized_copy(plain, tmp_path / "flux1-dev-fp8-scaled.safetensors",
                                torch.float8_e4m3fn)
    stored = load_file(file)
    assert stored["model.diffusion_model.scaled_fp8"].dtype == torch.float8_e4m3fn
    run_dir = tmp_path / "run"
    spec, layers = train_lora_from_single_file(run_dir, "tiny_flux", file, folder)

    frozen = {}
    for layer in layers:
        frozen.update({k.replace(".base_layer", ""): v for k, v in
                       layer.denoiser_state_dict(trainable_only=False).items() if "lora_" not in k})
    # The file by hand: each fp8 weight times its scale, then the BFL names mapped (diffusers'
    # converter splits at FLUX.1-dev's widths only).
    by_hand = {}
    for key, value in stored.items():
        name = key.removeprefix("model.diffusion_model.")
        if name == "scaled_fp8" or name.endswith(".scale_weight"):
            continue
        scale = stored.get(key.removesuffix(".weight") + ".scale_weight")
        by_hand[name] = value.float() * scale if scale is not None else value.float()
    config = json.loads((folder / "transformer" / "config.json").read_text())
    by_hand = from_bfl(by_hand, flux1_layout(config))
    assert frozen.keys() == by_hand.keys()
    for name, value in by_hand.items():
        torch.testing.assert_close(frozen[name].float(), value.to(frozen[name].dtype).float(),
                                   rtol=0, atol=0, msg=name)

    _, got, want = exported_lora_and_trained(run_dir, spec, layers)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
