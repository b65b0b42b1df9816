"""GPU checks (skipped without CUDA): the tiny model through the real path on GPUs."""

from __future__ import annotations

import pytest
import torch

from tests.cli import bench_rows, dpipe_train, metrics, train_args

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
BASE = ["dataset=synthetic", "train.precision=bf16", "train.max_steps=2",
        "pipeline.micro_batches=4", "train.checkpoint_every_steps=0"]


def _losses(run_dir, *overrides):
    model = [] if any(o.startswith("model=") for o in overrides) else ["model=tiny_flux"]
    result = dpipe_train(*train_args(run_dir, *model, *BASE, *overrides), timeout=600)
    assert result.code == 0, result.err[-3000:]
    return torch.tensor([m["loss"] for m in metrics(run_dir)])


def test_the_default_pipeline_runs_one_stage_on_one_gpu(tmp_path, monkeypatch):
    """`dpipe-train` with the defaults (pipeline=two_stage) on a machine that shows one GPU."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    result = dpipe_train(*train_args(tmp_path, "train.max_steps=2"), timeout=600)
    assert result.code == 0, result.err[-3000:]
    log = result.out + result.err
    assert "pipeline: 1 stage on 1 visible GPU: the default pipeline (pipeline=two_stage)" in log
    assert "1 processes = 1 stages x 1 data-parallel" in log
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("model", ["tiny_flux", "tiny_hunyuan_video"])
def test_two_stage_gpu_run_matches_one_stage_in_bf16(tmp_path, model):
    """HunyuanVideo's stages also send its latent grid, carried in the shape of an empty tensor
    (`dpipe.models.sync_free`): NCCL's zero-byte send and receive."""
    one = _losses(tmp_path / "one", f"model={model}", "pipeline.stages=1",
                  "pipeline.data_parallel=1")
    two = _losses(tmp_path / "two", f"model={model}", "pipeline.stages=2",
                  "pipeline.data_parallel=1")
    torch.testing.assert_close(two, one, rtol=2e-2, atol=1e-3)


def _audit(rows, name):
    return [(s["host_syncs"], s["backward_passes"]) for s in rows[name]["stages"]]


def test_a_one_gpu_step_makes_no_host_sync(tmp_path):
    """Every synchronizing CUDA operation counts (CUDA's sync debug mode), with the data arriving
    through the training loader as in `dpipe-train`."""
    one = "model=tiny_flux pipeline=single train.precision=bf16 pipeline.micro_batches=4"
    rows = bench_rows(tmp_path, {"lora": f"{one} pipeline.compile=true",
                                 "full": f"{one} model.mode=full optim.master_weights=false "
                                         "pipeline.compile=false"},
                      "--loader", timeout=600)
    assert _audit(rows, "lora") == [(0, 1)] and _audit(rows, "full") == [(0, 1)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_two_stage_gpu_step_makes_no_host_sync(tmp_path):
    """The shapes of each micro-batch's activations travel between the hosts, not as GPU tensors
    read back with `.item()`; each stage runs its backward once."""
    rows = bench_rows(tmp_path, {"two": "model=tiny_flux train.precision=bf16 pipeline.stages=2 "
                                        "pipeline.micro_batches=4"}, "--loader", timeout=600)
    assert _audit(rows, "two") == [(0, 1), (0, 1)]


def test_full_fine_tune_with_fp32_master_weights_trains_like_bf16_weights(tmp_path):
    """DeepSpeed's bf16 mode (bf16 layers, fp32 master weights in its optimizer) gets its data in
    bf16 and trains as the bf16-weights run does, within bf16 tolerance."""
    full = ("pipeline.stages=1", "pipeline.data_parallel=1", "model.mode=full", "optim.lr=1e-4")
    plain = _losses(tmp_path / "bf16", *full, "optim.master_weights=false")
    master = _losses(tmp_path / "master", *full, "optim.master_weights=true",
                     "pipeline.zero_stage=1")
    torch.testing.assert_close(master, plain, rtol=2e-2, atol=1e-3)


def test_compiled_blocks_match_eager_blocks(tmp_path):
    eager = _losses(tmp_path / "eager", "pipeline.stages=1", "pipeline.data_parallel=1",
                    "pipeline.compile=false")
    compiled = _losses(tmp_path / "compiled", "pipeline.stages=1", "pipeline.data_parallel=1",
                       "pipeline.compile=true")
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("model", ["tiny_wan", "tiny_flux"])
def test_compiled_blocks_recompute_as_they_keep(tmp_path, model):
    """Compiled and checkpointed (every layer recomputed in backward, as `auto` starts): the
    losses of compiled layers that keep their activations. Checkpointed from outside the compiled
    call, Wan's blocks failed their first backward on a GPU (dpipe.pipeline.recompute)."""
    one = ("pipeline.stages=1", "pipeline.data_parallel=1", "pipeline.compile=true",
           f"model={model}")
    kept = _losses(tmp_path / "kept", *one)
    recomputed = _losses(tmp_path / "recomputed", *one, "pipeline.activation_checkpointing=all")
    torch.testing.assert_close(recomputed, kept, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("model", ["tiny_hunyuan_video", "tiny_qwen_image"])
def test_flex_attention_trains_as_sdpa_does(tmp_path, model):
    """Under the text-padding mask: HunyuanVideo's layers build the joint mask, Qwen-Image's
    diffusers processor builds its own from the text mask."""
    one = (f"model={model}", "pipeline.stages=1", "pipeline.data_parallel=1",
           "pipeline.compile=true")
    sdpa = _losses(tmp_path / "sdpa", *one, "model.attention=sdpa")
    flex = _losses(tmp_path / "flex", *one, "model.attention=flex")
    torch.testing.assert_close(flex, sdpa, rtol=2e-2, atol=1e-3)


def test_auto_checkpointing_matches_no_checkpointing(tmp_path):
    none = _losses(tmp_path / "none", "pipeline.stages=1", "pipeline.data_parallel=1")
    auto = _losses(tmp_path / "auto", "pipeline.stages=1", "pipeline.data_parallel=1",
                   "pipeline.activation_checkpointing=auto", "pipeline.memory_budget_gb=0.001")
    torch.testing.assert_close(auto, none, rtol=2e-2, atol=1e-3)


def test_fp8_base_weights_compiled_train_close_to_bf16(tmp_path):
    bf16 = _losses(tmp_path / "bf16", "pipeline.stages=1", "pipeline.data_parallel=1",
                   "pipeline.compile=false")
    fp8 = _losses(tmp_path / "fp8", "pipeline.stages=1", "pipeline.data_parallel=1",
                  "model.base_dtype=fp8", "pipeline.compile=true")
    # Compiled vs eager alone is allowed 2e-2 (test above); fp8 storage adds ~0.1% (CPU test).
    torch.testing.assert_close(fp8, bf16, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_linears_hold_no_bf16_weight_copy_for_backward(compiled):
    from torch import nn

    from dpipe.train.fp8 import QuantizedLinear

    torch.manual_seed(0)
    layers = nn.Sequential(*[
        QuantizedLinear(nn.Linear(4096, 4096, bias=False).to("cuda", torch.bfloat16).requires_grad_(False))
        for _ in range(8)])
    model = torch.compile(layers) if compiled else layers
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    model(x).float().square().sum().backward()  # warm-up (compiles)
    x.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = model(x)
    held = torch.cuda.memory_allocated() - before
    # Kept for backward: 8 activations of 16 x 4096 bf16 (1 MiB). The upcast bf16 weights would
    # add 8 x 32 MiB; the fp8 weights themselves are parameters, allocated before.
    assert held < 16 * 2**20, f"{held / 2**20:.0f} MiB held after forward"
    y.float().square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    ref = x.detach()
    for layer in layers:
        ref = ref @ layer.dequantized().to(torch.bfloat16).t()
    err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 2e-2, err  # the same math as a bf16 matmul chain on the dequantized weights


@pytest.mark.parametrize("compiled", [False, True])
def test_cudnn_attention_trains_as_sdpa_does(tmp_path, monkeypatch, compiled):
    """Eager, cuDNN's backward read out of bounds on FLUX's single-block gradient (a slice) and
    trained to NaN until dpipe laid that gradient out as the output (dpipe.pipeline.attention).
    Each compiled run has its own inductor cache: the caches do not key on SDPA's kernel."""
    one = ("pipeline.stages=1", "pipeline.data_parallel=1",
           f"pipeline.compile={str(compiled).lower()}")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-sdpa"))
    sdpa = _losses(tmp_path / "sdpa", *one, "model.attention=sdpa")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-cudnn"))
    cudnn = _losses(tmp_path / "cudnn", *one, "model.attention=cudnn")
    assert torch.isfinite(cudnn).all()
    torch.testing.assert_close(cudnn, sdpa, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_gpu_defaults_compile_and_pick_the_attention_kernel(tmp_path, mode):
    """By default on a GPU the layers compile (pipeline.compile=null), and `model.attention=auto`
    trains a LoRA with cuDNN's kernel first on the GPUs of CUDNN_CHECKED and with the default
    kernels elsewhere, and a full fine-tune with the default kernels everywhere (compiled with
    cuDNN's, the tiny full fine-tune's gradients were NaN at its first step on an H200); the
    run's log says both, and the losses are finite."""
    from dpipe.pipeline.attention import CUDNN_CHECKED

    cudnn = torch.cuda.get_device_capability() in CUDNN_CHECKED and mode == "lora"
    run_dir = tmp_path / mode
    full = ["model.mode=full", "optim.master_weights=false"] if mode == "full" else []
    result = dpipe_train(*train_args(run_dir, "model=tiny_flux", *BASE, "pipeline.stages=1",
                                     "pipeline.data_parallel=1", *full), timeout=600)
    assert result.code == 0, result.err[-3000:]
    chosen = "cudnn" if cudnn else "sdpa"
    log = result.err + result.out
    assert f"model.attention=auto: {chosen} for a model.mode={mode} run on this GPU" in log
    assert "layers compile in the first step" in log
    assert torch.isfinite(torch.tensor([m["loss"] for m in metrics(run_dir)])).all()
    # The audited step's peak memory: recorded, and logged per stage.
    audited = next(m for m in metrics(run_dir) if "audited_step" in m)
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    assert 0 < audited["peak_memory_gib"] < total
    assert "peak GPU memory by stage" in log


SAMPLES = ["sample.prompts=[a red circle on a blue background, {prompt: a cat, seed: 3, width: 48}]",
           "sample.at_start=true", "sample.every_steps=1", "sample.steps=4",
           "sample.save_latents=true"]


def test_a_compiled_gpu_run_samples_what_the_diffusers_pipeline_does(tmp_path):
    """Samples through the compiled bf16 layers on the GPU at every step: written, logged with
    the memory they took, and close to FluxPipeline's fp32 latents on the CPU from the same
    exported LoRA (bf16 rounding apart)."""
    from tests.integration.sampled import diffusers_latents, saved_latents

    run_dir = tmp_path / "run"
    result = dpipe_train(*train_args(run_dir, "model=tiny_flux", *BASE, "pipeline.stages=1",
                                     "pipeline.data_parallel=1", "optim.lr=1e-3", *SAMPLES),
                         timeout=600)
    assert result.code == 0, result.err[-3000:]
    log = result.err + result.out
    assert "GiB of GPU memory on top of what was resident" in log
    for step in (0, 1, 2):
        assert (run_dir / "samples" / f"step_{step}" / "1.png").is_file()
    for k, expected in enumerate(diffusers_latents(run_dir, run_dir / "lora")):
        got = saved_latents(run_dir / "samples" / "step_2", k)
        assert (got - expected).abs().max() < 0.05 * expected.abs().max(), k


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_stage_gpu_samples_match_one_stage(tmp_path):
    """Sampling through 2 stages (NCCL between the GPUs) gives the 1-stage samples."""
    from tests.integration.sampled import saved_latents

    for stages in (1, 2):
        result = dpipe_train(*train_args(tmp_path / str(stages), "model=tiny_flux", *BASE,
                                         f"pipeline.stages={stages}", "pipeline.data_parallel=1",
                                         *SAMPLES), timeout=600)
        assert result.code == 0, result.err[-3000:]
    for k in (0, 1):
        one = saved_latents(tmp_path / "1" / "samples" / "step_2", k)
        two = saved_latents(tmp_path / "2" / "samples" / "step_2", k)
        torch.testing.assert_close(two, one, rtol=2e-2, atol=2e-2)
