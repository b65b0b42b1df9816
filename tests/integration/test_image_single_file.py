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

    from dpipe.data.batches import step_micro_batches
    from dpipe.models.chroma.original import original_state_dict
    from dpipe.models.chroma.tiny import make_tiny_chroma
    from tests.cli import dpipe_train, train_args
    from tests.integration.trained import cached_dataset, run_config, run_layers, trained_layers

    folder = make_tiny_chroma(tmp_path / "tiny-chroma")
    base = ChromaTransformer2DModel.from_pretrained(folder, subfolder="transformer")
    generator = torch.Generator().manual_seed(0)
    fine_tuned = {k: v + 0.05 * torch.randn(v.shape, generator=generator, dtype=v.dtype)
                  for k, v in base.state_dict().items()}  # someone's fine-tune of the base
    file = tmp_path / "Chroma1-HD-finetune.safetensors"
    save_file({f"model.diffusion_model.{k}": v.to(torch.bfloat16).contiguous()
               for k, v in original_state_dict(fine_tuned).items()}, file)

    run_dir = tmp_path / "run"
    result = dpipe_train(*train_args(
        run_dir, "model=tiny_chroma", f"model.path={file}", "model.tiny=false",
        f"model.single_file_config={folder}", "dataset=synthetic", "pipeline.stages=2",
        "pipeline.micro_batches=2", "optim.lr=1e-3", "train.checkpoint_every_steps=0",
        "train.max_steps=2"))
    assert result.code == 0, f"dpipe-train failed ({result.code}):\n{result.out}\n{result.err}"
    spec, layers = trained_layers(run_dir)
    assert spec.single_file == file and spec.path == folder
    trained = {}
    for layer in layers:
        trained.update(layer.denoiser_state_dict(trainable_only=False))
    for diffusers_name in ("single_transformer_blocks.1.proj_mlp.weight",  # from linear1's split
                           "transformer_blocks.0.attn.add_k_proj.weight"):  # from txt_attn.qkv
        lora_name = diffusers_name.replace(".weight", ".base_layer.weight")
        got = trained.get(lora_name, trained.get(diffusers_name))
        want = fine_tuned[diffusers_name].to(torch.bfloat16).float()
        torch.testing.assert_close(got.float(), want, rtol=0, atol=0)

    dataset, plan = cached_dataset(run_dir)
    inputs, _ = next(step_micro_batches(spec, dataset, plan, run_config(run_dir).train.timesteps,
                                        1, 0, 0))
    with torch.no_grad():
        got = spec.denoiser_forward(spec.load_denoiser_with_lora(run_dir / "lora"), inputs)
        folder_base = spec.denoiser_forward(base, inputs)
    want = run_layers(layers, inputs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (folder_base - want).abs().max() > 1e-3  # the folder's transformer is another model
