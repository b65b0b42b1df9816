"""Which default makes the tiny FLUX full fine-tune's second loss NaN on an H200 (thirteenth
session): test_full_fine_tune_with_fp32_master_weights_trains_like_bf16_weights failed under
the defaults then (compiled, cuDNN first). Each case: the losses of 2 steps. Each case names
both keys: `auto` now keeps full fine-tunes on the default kernels."""
import sys
import tempfile
from pathlib import Path

from tests.cli import dpipe_train, metrics, train_args

BASE = ["model=tiny_flux", "dataset=synthetic", "train.precision=bf16", "train.max_steps=2",
        "pipeline.micro_batches=4", "train.checkpoint_every_steps=0", "pipeline.stages=1",
        "pipeline.data_parallel=1", "model.mode=full", "optim.lr=1e-4"]
PLAIN = ["optim.master_weights=false"]
MASTER = ["optim.master_weights=true", "pipeline.zero_stage=1"]
SDPA_COMPILED = ["model.attention=sdpa", "pipeline.compile=true"]
CUDNN_EAGER = ["model.attention=cudnn", "pipeline.compile=false"]
CUDNN_COMPILED = ["model.attention=cudnn", "pipeline.compile=true"]  # the failing case
CASES = {
    "plain sdpa compiled": PLAIN + SDPA_COMPILED, "master sdpa compiled": MASTER + SDPA_COMPILED,
    "plain cudnn eager": PLAIN + CUDNN_EAGER, "master cudnn eager": MASTER + CUDNN_EAGER,
    "plain cudnn compiled": PLAIN + CUDNN_COMPILED, "master cudnn compiled": MASTER + CUDNN_COMPILED,
}
for name in sys.argv[1:] or CASES:
    run_dir = Path(tempfile.mkdtemp()) / "run"
    result = dpipe_train(*train_args(run_dir, *BASE, *CASES[name]), timeout=300)
    losses = [m["loss"] for m in metrics(run_dir)] if result.code == 0 else result.err[-800:]
    print(f"{name}: {losses}", flush=True)
