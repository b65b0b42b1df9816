"""Each rank reads only its pipeline stage's weights, in the dtype training keeps them in
(`dpipe.train.trainable`): the layers equal those of the whole denoiser loaded in fp32 bit for bit,
and a mid-size denoiser's stage stays within the host memory the plan states for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpipe.config.compose import compose_run
from dpipe.models.common.tiny_files import save_exact_shards
from dpipe.models.stage_weights import DenoiserSkeleton
from dpipe.models.registry import build_spec
from dpipe.pipeline.partition import stage_bounds
from dpipe.train.trainable import load_denoiser, trainable_layers

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", [["train.precision=bf16"], ["model.mode=full"],
                                  ["model.adapter=lokr", "train.precision=bf16",
                                   "model.base_dtype=fp8"],
                                  ["model=tiny_z_image", "train.precision=bf16"],
                                  # magnitudes from the fp32 base's norms, as the whole load's
                                  ["model.adapter=dora", "train.precision=bf16"],
                                  # a full fine-tune: SDXL's LoRA layers take seconds to count
                                  ["model=tiny_sdxl", "model.mode=full"],
                                  ["model=tiny_omnigen2", "train.precision=bf16"],
                                  ["model=tiny_anima", "train.precision=bf16"]])
def test_each_stage_reads_the_weights_the_whole_load_gives(mode):
    _assert_stages_read_the_whole_load(["model=tiny_flux", *mode])


def _scaled_fp8(plain: Path, out: Path) -> Path:
    from dpipe.models.common.quantized_files import write_quantized_copy

    return write_quantized_copy(plain, out, torch.float8_e4m3fn)


def _comfy_quant(plain: Path, out: Path) -> Path:
    from tests.unit.test_comfy_quant import comfy_quant_copy

    return comfy_quant_copy(plain, out)


def _gguf(quant: str, arch: str):
    """A writer of the plain file as a `quant` GGUF of `arch` (test_gguf_files' writers)."""
    def write(plain: Path, out: Path) -> Path:
        from tests.unit.test_gguf_files import gguf_copy

        return gguf_copy(plain, out.with_suffix(".gguf"), quant, arch)

    return write


# case -> (model, the file's name as released, its writer, the writer's key prefix, the bytes
# read per run of the converter, the quantizer of the plain file or None, overrides)
SINGLE_FILES = {
    # ComfyUI's: BFL's names, fused q/k/v and q/k/v/MLP, the prefix. A batch per fused tensor
    # and the tensors the converter joins to it, as a real file's stage is read BATCH_BYTES at
    # a time.
    "flux": ("tiny_flux", "flux1-dev.safetensors",
             "dpipe.models.flux.tiny:write_bfl_single_file", "model.diffusion_model.", 1, None),
    # the Cosmos transformer under NVIDIA's names and the text adapter: two models in one file
    "anima": ("tiny_anima", "anima-preview.safetensors",
              "dpipe.models.anima.tiny:write_single_file", "net.", None, None),
    # ComfyUI's fp8_scaled (one scale a tensor, the marker), and its comfy_quant layers (fp8,
    # int8 tensor-wise and convrot, nvfp4, mxfp8): each Linear's weight read with its scales,
    # and the LoRA's frozen Linears keep the file's bytes (dpipe.train.stored_base); the stage
    # in one batch (batches are the plain file's case)
    "flux_fp8_scaled": ("tiny_flux", "flux1-dev.safetensors",
                        "dpipe.models.flux.tiny:write_bfl_single_file", "model.diffusion_model.",
                        None, _scaled_fp8),
    "flux_comfy_quant": ("tiny_flux", "flux1-dev.safetensors",
                         "dpipe.models.flux.tiny:write_bfl_single_file",
                         "model.diffusion_model.", None, _comfy_quant),
    # fp8 matmuls: the file's fp8 layers as stored, its int8 layers quantized from their values
    "flux_comfy_quant_fp8_compute": ("tiny_flux", "flux1-dev.safetensors",
                                     "dpipe.models.flux.tiny:write_bfl_single_file",
                                     "model.diffusion_model.", None, _comfy_quant,
                                     "model.base_compute=fp8"),
    # DoRA: magnitudes from the file's values, its Linears holding their stored forms
    "flux_fp8_scaled_dora": ("tiny_flux", "flux1-dev.safetensors",
                             "dpipe.models.flux.tiny:write_bfl_single_file",
                             "model.diffusion_model.", None, _scaled_fp8, "model.adapter=dora"),
    # GGUF (city96's layout: BFL's names, no prefix): Q8_0 blocks moved whole by the converter
    # (fused q/k/v split along rows), kept in GGUF Linears; K-quant blocks where rows are 256
    # wide (the time and guidance embeddings); the F32 tensors cast. A batch per fused tensor.
    "flux_gguf_q8_0": ("tiny_flux", "flux1-dev.safetensors",
                       "dpipe.models.flux.tiny:write_bfl_single_file", "model.diffusion_model.",
                       1, _gguf("Q8_0", "flux")),
    "flux_gguf_q4_k": ("tiny_flux", "flux1-dev.safetensors",
                       "dpipe.models.flux.tiny:write_bfl_single_file", "model.diffusion_model.",
                       None, _gguf("Q4_K", "flux")),
    # Anima's own skeleton (two models in one file), NVIDIA's names
    "anima_gguf": ("tiny_anima", "anima-preview.safetensors",
                   "dpipe.models.anima.tiny:write_single_file", "net.", None,
                   _gguf("Q8_0", "cosmos")),
    # the other families with GGUF files in test_gguf_files: their converters over blocks
    "z_image_gguf": ("tiny_z_image", "z_image_turbo_bf16.safetensors",
                     "dpipe.models.z_image.tiny:write_single_file", "model.diffusion_model.",
                     None, _gguf("Q8_0", "lumina2")),
    "minimax_h3_gguf": ("tiny_minimax_h3", "minimax_h3.safetensors",
                        "dpipe.models.minimax_h3.tiny:write_single_file",
                        "model.diffusion_model.", None, _gguf("Q8_0", "minimax_h3"))}


@pytest.mark.parametrize("case", list(SINGLE_FILES))
def test_each_stage_reads_its_weights_of_a_single_file(tmp_path, monkeypatch, case):
    """A bf16 LoRA from the model's single file: each stage reads only the file's tensors of its
    own weights, mapped by the family's converter."""
    from dpipe.models import single_file_weights
    from dpipe.models.family import imported

    model, name, writer, prefix, batch, quantize, *overrides = SINGLE_FILES[case]
    if batch is not None:
        monkeypatch.setattr(single_file_weights, "BATCH_BYTES", batch)
    run = compose_run([f"model={model}"], world_size=2)
    build_spec(run.model).ensure_available()
    file = imported(writer)(Path(run.model.path), tmp_path / name, prefix)
    if quantize is not None:
        file = quantize(file, tmp_path / f"{case}.safetensors")
    _assert_stages_read_the_whole_load([f"model={model}", f"model.path={file}",
                                        f"model.single_file_config={run.model.path}",
                                        "train.precision=bf16", *overrides])


@pytest.mark.parametrize("quantize", [None, _scaled_fp8])
def test_each_stage_reads_its_unet_weights_of_an_sdxl_checkpoint(tmp_path, quantize):
    """SDXL's whole pipeline in one file (Stability's names, the UNet under
    "model.diffusion_model.", the VAE and both text encoders beside it), plain and as
    ComfyUI's fp8_scaled: each stage reads its UNet tensors alone, mapped by the converter
    diffusers' from_single_file runs. A full fine-tune: SDXL's LoRA layers take seconds to
    count."""
    from dpipe.models.sdxl.tiny import SINGLE_FILE

    run = compose_run(["model=tiny_sdxl"], world_size=2)
    build_spec(run.model).ensure_available()
    folder = Path(run.model.path)
    file = folder / SINGLE_FILE
    if quantize is not None:
        file = quantize(file, tmp_path / SINGLE_FILE)
    _assert_stages_read_the_whole_load(["model=tiny_sdxl", f"model.path={file}",
                                        f"model.single_file_config={folder}",
                                        "model.mode=full"])


def _assert_stages_read_the_whole_load(overrides: list[str]) -> None:
    run = compose_run([*overrides, "pipeline.stages=2"], world_size=2)
    spec = build_spec(run.model)
    spec.ensure_available()
    assert isinstance(load_denoiser(spec, run, 0), DenoiserSkeleton)
    whole = trainable_layers(spec, run)  # no stage: the whole denoiser, loaded in fp32
    p = run.pipeline
    bounds = stage_bounds(spec.layer_costs(whole), p.stages, p.partition, p.split)
    for stage in range(p.stages):
        layers = trainable_layers(spec, run, stage=stage)
        for i, layer in enumerate(layers):
            state, expected = layer.state_dict(), whole[i].state_dict()
            assert state.keys() == expected.keys()
            local = bounds[stage] <= i < bounds[stage + 1]
            frozen = {k for k, q in layer.named_parameters() if not q.requires_grad}
            for key, value in state.items():
                if local:
                    assert value.dtype == expected[key].dtype, (i, key)
                    assert torch.equal(value, expected[key]), (i, key)
                elif key in frozen:  # another stage's base weights: never read
                    assert value.is_meta, (stage, i, key)
            if local:  # and the buffers not saved: a stored Linear's scales
                buffers = dict(whole[i].named_buffers())
                for key, value in layer.named_buffers():
                    assert torch.equal(value, buffers[key]), (i, key)
                assert ([type(m) for m in layer.modules()] ==
                        [type(m) for m in whole[i].modules()]), i


# A FLUX.1-style denoiser of 145M parameters (290 MB in bf16, 3 shards): big enough that the
# stage's weights stand out from the allocator's noise, small enough to write in a second.
MID_FLUX = dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4,
                attention_head_dim=64, num_attention_heads=16, joint_attention_dim=1024,
                pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 24, 24))


@pytest.mark.slow  # a worker process (its imports: ~6 s)
def test_a_stage_loads_within_the_host_memory_the_plan_states(tmp_path):
    """The whole denoiser in fp32 (what every rank loaded before) would take 580 MB; stage 0 of
    2 of a bf16 LoRA holds about half of its bf16 weights. The worker measures the rise of its
    resident memory's peak while it loads (VmHWM, from a reset), against
    `dpipe.pipeline.memory.loading_bytes` for that stage (the plan's figure): from the diffusers
    folder, then from the same weights as ComfyUI's single file in BFL's layout (its fused
    tensors split by the converter), as its fp8_scaled file and as a Q8_0 GGUF, whose block
    Linears the LoRA keeps as stored (1 and 34/32 bytes a value): a lower bound than bf16's."""
    from diffusers import FluxTransformer2DModel

    from dpipe.models.common.gguf_files import write_gguf_copy
    from dpipe.models.common.quantized_files import write_quantized_copy
    from dpipe.models.flux.tiny import write_bfl_single_file

    folder = tmp_path / "flux"  # the denoiser's folder is all that loading reads
    with torch.device("meta"):
        model = FluxTransformer2DModel(**MID_FLUX).to(torch.bfloat16)
    model.to_empty(device="cpu")
    for param in model.parameters():
        param.data.fill_(0.01)  # the values do not matter here; their bytes do
    save_exact_shards(model, folder / "transformer", shards=3)
    del model
    file = write_bfl_single_file(folder, tmp_path / "flux1-dev.safetensors",
                                 "model.diffusion_model.")
    files = [file, write_quantized_copy(file, tmp_path / "flux1-dev-fp8.safetensors",
                                        torch.float8_e4m3fn),
             write_gguf_copy(file, tmp_path / "flux1-dev-Q8_0.gguf", "Q8_0", "flux")]
    run = ["model=tiny_flux", "pipeline.stages=2", "train.precision=bf16"]
    groups = [[*run, f"model.path={folder}"]] + [
        ["--", *run, f"model.path={f}", f"model.single_file_config={folder}"] for f in files]
    result = subprocess.run(
        [sys.executable, "-m", "tests.unit.stage_loading_worker", "0", *sum(groups, [])],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 << 10)})
    assert result.returncode == 0, result.stderr[-3000:]
    measured = [json.loads(line) for line in result.stdout.strip().splitlines()[-4:]]
    print("RSS rise / bound (MB): folder, plain, fp8_scaled, Q8_0 GGUF:",
          [(round(m["rise"] / 1e6), round(m["bound"] / 1e6)) for m in measured])
    folder_bound, plain, fp8, gguf = (m["bound"] for m in measured)
    assert folder_bound == plain
    assert 100e6 < plain < 290e6  # about half the bf16 weights, one layer in transit
    # the blocks' Linears at 1 and 34/32 bytes, not 2 (the fp8 file's batches, dequantized in
    # fp32, take more than its largest layer in transit)
    assert gguf < plain and fp8 < plain
    for folder_or_file in measured:
        assert folder_or_file["rise"] <= folder_or_file["bound"], measured
