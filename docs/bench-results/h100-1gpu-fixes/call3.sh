#!/bin/bash
# Device call 3 (2026-12-06, one H100): LTX-2.3 with sound after the AVState fix (no graph break
# in its layers): tiny, compiled, its host syncs; then at its released size (--size 22b: 121
# frames at 512x768 and 126 audio latents per clip), LoRA r32, 2 micro-batches, compiled, auto
# checkpointing at 74 GiB, as call 1 of ../h100-1gpu-real-sizes measured it before the fix.
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
DEADLINE=$(( $(date +%s) + ${BUDGET:-570} ))
SIZE=tiny bench ltxav-tiny 60 --warmup 2 --steps 1 \
  --run "av: model=tiny_ltx23 model.audio=true pipeline=single train.precision=bf16 pipeline.micro_batches=4 pipeline.compile=true"
A="pipeline.activation_checkpointing=auto pipeline.memory_budget_gb=74"
L2="train.precision=bf16 pipeline.micro_batches=2 pipeline.compile=true model.lora.rank=32 model.lora.alpha=32"
SIZE=22b bench ltx23av 200 --warmup 1 --steps 1 \
  --run "lora-av: model=ltx23 model.audio=true pipeline=single $L2 $A"
