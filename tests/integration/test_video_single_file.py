"""A real 2-stage LoRA run of HunyuanVideo from a single-file transformer in the original /
ComfyUI layout (model.path=<file>, model.single_file_config=<diffusers folder>)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.slow
def test_hunyuan_video_trains_from_a_single_file(tmp_path):
    """The file's weights differ from the folder's transformer, so the run must have trained the
    file's: its checkpoint holds the file's frozen weights, and the exported LoRA, loaded into a
    HunyuanVideoPipeline whose transformer comes from that file, reproduces the trained model."""
    from diffusers import HunyuanVideoTransformer3DModel
    from safetensors.torch import save_file

    from dpipe.models.hunyuan_video.original import original_state_dict
    from dpipe.models.hunyuan_video.tiny import make_tiny_hunyuan_video
    from tests.integration.trained import (
        exported_lora_and_trained, perturbed, train_lora_from_single_file)

    folder = make_tiny_hunyuan_video(tmp_path / "tiny-hunyuan-video")
    base = HunyuanVideoTransformer3DModel.from_pretrained(folder, subfolder="transformer")
    fine_tuned = perturbed(base.state_dict())
    file = tmp_path / "hunyuan_video_finetune_bf16.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous()
               for k, v in original_state_dict(fine_tuned).items()}, file)

    run_dir = tmp_path / "run"
    spec, layers = train_lora_from_single_file(run_dir, "tiny_hunyuan_video", file, folder)
    trained = {}
    for layer in layers:
        trained.update(layer.denoiser_state_dict(trainable_only=False))
    name = "transformer_blocks.0.attn.to_q.base_layer.weight"
    want = fine_tuned["transformer_blocks.0.attn.to_q.weight"].to(torch.bfloat16).float()
    torch.testing.assert_close(trained.get(name, trained.get(name.replace(".base_layer", ""))),
                               want, rtol=0, atol=0)

    inputs, got, want = exported_lora_and_trained(run_dir, spec, layers)
    with torch.no_grad():
        folder_base = spec.denoiser_forward(base, inputs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (folder_base - want).abs().max() > 1e-3  # the folder's transformer is another model
