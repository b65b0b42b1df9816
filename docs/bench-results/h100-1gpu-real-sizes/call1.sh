#!/bin/bash
# Device call 1 (2026-12-06, one H100): dpipe-bench at the released sizes, LoRA r32, 8
# micro-batches, compiled, one GPU: Krea 2 (--size 12b, 1024^2) and Ideogram 4 (--size 9b-1024)
# without checkpointing; LTX-2.3 with sound (--size 22b, model.audio=true: 121 frames at 512x768
# and 126 audio latents per clip) with activation_checkpointing=auto at a 74 GiB budget.
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
DEADLINE=$(( $(date +%s) + ${BUDGET:-570} ))
A="pipeline.activation_checkpointing=auto pipeline.memory_budget_gb=74"
SIZE=22b bench ltx23av 260 --warmup 2 --steps 2 \
  --run "lora-av: model=ltx23 model.audio=true pipeline=single $L $A"
SIZE=12b bench krea2 150 --warmup 1 --steps 2 --run "lora: model=krea2 pipeline=single $L"
SIZE=9b-1024 bench ideogram4 150 --warmup 1 --steps 2 --run "lora: model=ideogram4 pipeline=single $L"
