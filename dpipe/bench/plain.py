"""The reference: a plain single-GPU loop with no pipeline engine, as fast as it is simple to
make it: the diffusers model's own forward, every repeated block compiled, no activation
checkpointing, bf16 autocast, fused AdamW. `python -m dpipe.bench.plain DIR`."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dpipe.bench.worker import fixed_micro_batches
from dpipe.config.schema import Precision, TrainMode
from dpipe.launch.run_rank import RUN_CONFIG, load_run_config
from dpipe.models.registry import build_spec
from dpipe.train.lora import make_trainable
from dpipe.pipeline.attention import use_attention_kernel, use_sdpa_kernels


def main() -> int:
    bench_dir = Path(sys.argv[1])
    opts = json.loads((bench_dir / "bench.json").read_text())
    run = load_run_config(bench_dir / RUN_CONFIG)
    use_sdpa_kernels(run.model, compiles=True)  # the same kernels as the pipeline's run
    spec = build_spec(run.model).for_benchmark(opts["size"])
    full = run.model.mode == TrainMode.full
    dtype = torch.bfloat16 if run.train.precision == Precision.bf16 else torch.float32
    denoiser = spec.random_denoiser(opts["size"], dtype, torch.device("cuda"))
    make_trainable(denoiser, run.model, spec.lora_targets())
    use_attention_kernel(denoiser, run.model)  # the same kernel as the pipeline's run
    denoiser.compile_repeated_blocks()
    params = [p for p in denoiser.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=run.optim.lr, fused=True)
    batches = [
        (tuple(t.cuda() for t in inputs), tuple(t.cuda() for t in labels))
        for inputs, labels in fixed_micro_batches(spec, opts["size"], run.pipeline.micro_batches,
                                                  run.pipeline.micro_batch_size, run.train.seed)
    ]
    flops = sum(spec.train_flops(denoiser, inputs, full) for inputs, _ in batches)
    times = []
    for step in range(opts["warmup"] + opts["steps"]):
        if step == opts["warmup"]:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for inputs, labels in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = spec.loss(spec.denoiser_forward(denoiser, inputs), labels)
            (loss / len(batches)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        print(f"[plain] step {step} {times[-1]:.3f}s", flush=True)
    result = {"step_s": statistics.median(times[opts["warmup"]:]), "flops_per_step": flops,
              "images_per_step": run.pipeline.micro_batch_size * run.pipeline.micro_batches,
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    (bench_dir / "plain.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
