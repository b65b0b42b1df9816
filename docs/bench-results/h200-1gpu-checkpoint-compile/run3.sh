#!/bin/bash
# For one H200 (eleventh session): target 4's 24 GiB row again (FLUX.1-dev LoRA r32, fp8 base
# weights, compiled, `auto` checkpointing, the H200 capped at 24 GiB), now that compiled layers
# recompute inside their compiled graph. As ../h200-1gpu-loader-fp8/run4.sh; run through call.sh.
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
bench fp8auto24 200 --warmup 2 --steps 3 --loader --memory-cap-gb 24 --run "lora-1gpu-fp8-auto-24GiB: pipeline=single $L model.base_dtype=fp8 pipeline.activation_checkpointing=auto pipeline.memory_budget_gb=24"
