"""Per family at real size, on the CPU (meta device): the model-FLOP convention's count of one
8-image training step against the FLOPs it executes (dpipe.train.flops), and what that makes
of steps timed on an H200 (docs/performance.md). `python docs/bench-results/cpu-executed-flops/ratios.py`"""

import torch

from dpipe.bench.worker import fixed_micro_batches
from dpipe.cli.bench import PEAK_TFLOPS
from dpipe.config.compose import compose_run
from dpipe.models.registry import build_spec
from dpipe.train.flops import StepFlops, shapes_of

# (family, size, mode, timed s/step on one H200 or None, where the time is from)
RUNS = [
    ("flux", "dev", "lora", 3.753, "FLUX.1-dev LoRA r32, third session"),
    ("flux", "dev", "full", 4.386, "FLUX.1-dev full fine-tune, bf16 states"),
    ("hunyuan_video", "13b", "lora", 10.371, "HunyuanVideo LoRA, text cut (seventh session)"),
    ("hidream", "i1", "lora", 5.859, "HiDream-I1 LoRA, sync-free MoE (eighth session)"),
    ("z_image", "6b", "lora", None, "not timed yet"),
    ("lumina2", "2b", "lora", None, "not timed yet"),
    ("qwen_image", "20b", "lora", None, "not timed yet"),
    ("hunyuan_video15", "8b", "lora", None, "not timed yet"),
    ("wan", "14b", "lora", None, "not timed yet"),
]

for family, size, mode, step_s, what in RUNS:
    run = compose_run([f"model={family}", "model.path=/unused", "dataset=synthetic",
                       f"model.mode={mode}", "model.lora.rank=32", "model.lora.alpha=32"])
    spec = build_spec(run.model).for_benchmark(size)
    batches = fixed_micro_batches(spec, size, 1, 1, seed=0)
    denoiser = spec.random_denoiser(size, torch.float32, torch.device("meta"))
    convention = 8 * spec.train_flops(denoiser, batches[0][0], full=mode == "full")
    meta = lambda: spec.random_denoiser(size, torch.float32, torch.device("meta"))  # noqa: E731
    executed = 8 * StepFlops(spec, run, meta).of(shapes_of(*b) for b in batches)
    line = (f"{family} {size} {mode}: convention {convention / 1e15:.3f} PFLOP/step, executed "
            f"{executed / 1e15:.3f} ({convention / executed:.2f}x)")
    if step_s:
        line += (f"; at {step_s} s/step: {convention / step_s / 1e12:.0f} TFLOP/s by the convention"
                 f" ({convention / step_s / 1e12 / PEAK_TFLOPS:.0%}), {executed / step_s / 1e12:.0f}"
                 f" executed ({executed / step_s / 1e12 / PEAK_TFLOPS:.0%}) - {what}")
    print(line, flush=True)
