#!/bin/bash
# Device call 2 (2026-12-07, one GPU, the machine of call 1): LTX-2.3 22B video only, as call 1's
# run with sound (the baseline of the sound/video ratio, on the same card); then Krea 2 12B and
# Ideogram 4 9B at 1024^2, LoRA r32, 8 micro-batches, compiled: their host syncs per step.
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
DEADLINE=$(( $(date +%s) + ${BUDGET:-570} ))
A="pipeline.activation_checkpointing=auto pipeline.memory_budget_gb=74"
SIZE=22b bench ltx23v 300 --warmup 1 --steps 1 \
  --run "lora-video: model=ltx23 pipeline=single $L $A"
SIZE=12b bench krea2 130 --warmup 1 --steps 1 --run "lora: model=krea2 pipeline=single $L"
SIZE=9b-1024 bench ideogram4 130 --warmup 1 --steps 1 --run "lora: model=ideogram4 pipeline=single $L"
