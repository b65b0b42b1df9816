"""A real 2-stage LoRA run of Chroma from a single-file transformer in the original layout under
ComfyUI's prefix (model.path=<file>, model.single_file_config=<diffusers folder>): the family
whose single blocks dpipe splits itself rather than through diffusers' fixed-width converter."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.slow
def test_chroma_trains_from_a_single_file(tmp_path):
    """The file's weights differ from the folder's transformer, so the run must have trained the
    file's: its stages hold the file's frozen weights, and the exported LoRA, loaded into a
    ChromaPipeline whose transformer comes from that file, reproduces the trained model."""
    from diffusers import ChromaTransformer2DModel
    from safetensors.torch import save_file

    from dpipe.models.chroma.original import original_state_dict
    from dpipe.models.chroma.tiny import make_tiny_chroma
    from tests.integration.trained import (
        exported_lora_and_trained, perturbed, train_lora_from_single_file)

    folder = make_tiny_chroma(tmp_path / "tiny-chroma")
    base = ChromaTransformer2DModel.from_pretrained(folder, subfolder="transformer")
    fine_tuned = perturbed(base.state_dict())
    file = tmp_path / "Chroma1-HD-finetune.safetensors"
    save_file({f"model.diffusion_model.{k}": v.to(torch.bfloat16).contiguous()
               for k, v in original_state_dict(fine_tuned).items()}, file)

    run_dir = tmp_path / "run"
    spec, layers = train_lora_from_single_file(run_dir, "tiny_chroma", file, folder)
    trained = {}
    for layer in layers:
        trained.update(layer.denoiser_state_dict(trainable_only=False))
    for diffusers_name in ("single_transformer_blocks.1.proj_mlp.weight",  # from linear1's split
                           "transformer_blocks.0.attn.add_k_proj.weight"):  # from txt_attn.qkv
        lora_name = diffusers_name.replace(".weight", ".base_layer.weight")
        got = trained.get(lora_name, trained.get(diffusers_name))
        want = fine_tuned[diffusers_name].to(torch.bfloat16).float()
        torch.testing.assert_close(got.float(), want, rtol=0, atol=0)

    inputs, got, want = exported_lora_and_trained(run_dir, spec, layers)
    with torch.no_grad():
        folder_base = spec.denoiser_forward(base, inputs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (folder_base - want).abs().max() > 1e-3  # the folder's transformer is another model
