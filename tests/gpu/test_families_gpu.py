"""Every model family, on its tiny flavor, trains on one GPU (skipped without CUDA).

Per mode (MODES), sweeps of the families side by side (`dpipe-train -m model=...`), bf16 LoRA
on one stage, through the loader's worker processes as users run it. Each run's audited step
(`train.audit_step`, the second) makes no host sync, but where diffusers' own code of the family
makes one; the CPU suite holds the layers to the same on the meta device
(`tests/integration/test_families.py`). With cuDNN's attention kernel every family trains to the
losses of the default kernels.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.cli import Sweep, metrics
from tests.integration.test_families import FAMILIES as ALL_FAMILIES

# A device call (10 minutes) holds about one compiled sweep of every family; GPU_FAMILIES
# ("tiny_flux,tiny_wan") runs a share of them, e.g. half per call.
FAMILIES = (os.environ["GPU_FAMILIES"].split(",") if os.environ.get("GPU_FAMILIES")
            else ALL_FAMILIES)
assert set(FAMILIES) <= set(ALL_FAMILIES), \
    f"GPU_FAMILIES names no tiny family: {sorted(set(FAMILIES) - set(ALL_FAMILIES))}"

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MICRO_BATCHES = 2
SWEEP = ["dataset=synthetic", "pipeline=single", "train.precision=bf16", "train.max_steps=2",
         f"pipeline.micro_batches={MICRO_BATCHES}", "train.checkpoint_every_steps=0",
         "train.progress_bar=false"]
# Host syncs per step that come from diffusers' code, not dpipe's (measured on an H200,
# docs/bench-results/h200-1gpu-families): (family, mode) -> syncs in the audited step.
DIFFUSERS_SYNCS = {
    # ChromaCombinedTimestepTextProjEmbeddings embeds a CPU tensor and copies it to the GPU.
    ("tiny_chroma", "eager"): MICRO_BATCHES, ("tiny_chroma", "compiled"): MICRO_BATCHES,
    # LTX2AudioVideoRotaryPosEmbed.prepare_video_coords makes two small tensors from Python lists
    # on the GPU in every block (compiled, they are constants).
    ("tiny_ltx2", "eager"): 16,
    # HiDreamImageTransformer2DModel.patchify makes its img_sizes from a Python list on the GPU
    # once per micro-batch (dpipe does not use them; compiled, they are a constant).
    ("tiny_hidream", "eager"): MICRO_BATCHES,
}


# Sweeps run side by side on the one GPU: a tiny model's run is mostly single-threaded start-up
# and compilation (10-270 s per family compiled), so one sweep of all families outlasted a
# 560 s device call (docs/bench-results/h200-1gpu-families, call 4).
SIDE_BY_SIDE = 4


# The overrides of each mode's sweeps; eager and compiled with PyTorch's default kernels (the
# default, auto, is cudnn on the GPUs of dpipe.pipeline.attention.CUDNN_CHECKED).
MODES = {"eager": ["pipeline.compile=false", "model.attention=sdpa"],
         "compiled": ["pipeline.compile=true", "model.attention=sdpa"],
         "cudnn": ["pipeline.compile=false", "model.attention=cudnn"],
         "cudnn-compiled": ["pipeline.compile=true", "model.attention=cudnn"]}
# The mode of the same runs with the default kernels.
WITH_SDPA = {"cudnn": "eager", "cudnn-compiled": "compiled"}
_swept: dict[str, dict[str, Sweep]] = {}


def families_swept(tmp_path_factory, *modes: str) -> dict[str, Sweep]:
    """{family: the sweep it ran in} for the first of MODES given, swept once per session. The
    modes not yet swept are swept together, side by side: a test comparing two modes needs both."""
    todo = [m for m in dict.fromkeys(modes) if m not in _swept]
    # Fewer families than lanes (GPU_FAMILIES=one) leave lanes empty: a sweep of no model is none.
    lanes = [(mode, FAMILIES[i::SIDE_BY_SIDE]) for mode in todo
             for i in range(min(SIDE_BY_SIDE, len(FAMILIES)))]
    dirs = [tmp_path_factory.mktemp(f"{mode}-{i}") for i, (mode, _) in enumerate(lanes)]
    if lanes:
        with ThreadPoolExecutor(len(lanes)) as pool:
            sweeps = list(pool.map(
                lambda d, lane: Sweep(d, f"model={','.join(lane[1])}", *SWEEP, *MODES[lane[0]],
                                      timeout=3000),
                dirs, lanes))
    for mode in todo:
        _swept[mode] = {model: sweep for (m, group), sweep in zip(lanes, sweeps) if m == mode
                        for model in group}
    return _swept[modes[0]]


def audited_runs(mode: str, model: str, tmp_path_factory, *side_by_side: str) -> list[dict]:
    """The run of `model` in `mode`'s sweep (swept beside the modes `side_by_side`, if not yet),
    held to no host syncs but diffusers' own."""
    sweep = families_swept(tmp_path_factory, mode, *side_by_side)
    records = metrics(sweep[model].run_dir(f"model={model}"))
    assert [r["step"] for r in records] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in records)
    audited = records[1]
    assert audited["backward_passes_per_micro_batch"] == 1.0
    # With cuDNN's kernel a run syncs as it does with the default kernels.
    assert audited["host_syncs"] == DIFFUSERS_SYNCS.get((model, WITH_SDPA.get(mode, mode)), 0)
    return records


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("model", FAMILIES)
def test_family_trains_on_a_gpu_without_host_syncs(tmp_path_factory, mode, model):
    audited_runs(mode, model, tmp_path_factory)


@pytest.mark.parametrize("mode", ["cudnn", "cudnn-compiled"])
@pytest.mark.parametrize("model", FAMILIES)
def test_family_trains_with_cudnn_attention_as_with_sdpa(tmp_path_factory, mode, model):
    """`model.attention=cudnn` (whose backward once read out of bounds on FLUX, eager) gives every
    family the losses of PyTorch's default kernels, in bf16's tolerance. Compiled, each choice
    has its own inductor cache (dpipe.pipeline.attention), so these are cuDNN's own kernels."""
    sdpa = torch.tensor([r["loss"] for r in audited_runs(WITH_SDPA[mode], model, tmp_path_factory,
                                                          mode)])
    cudnn = torch.tensor([r["loss"] for r in audited_runs(mode, model, tmp_path_factory)])
    torch.testing.assert_close(cudnn, sdpa, rtol=2e-2, atol=1e-3)
