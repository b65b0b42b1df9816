#!/bin/bash
# Device call 4 (2026-12-06): call1 in the 6 minutes of device time left: the same three models at
# their released sizes (LoRA r32, compiled, one GPU), 2 micro-batches of one sample per step in
# place of 8, one warm-up step and two timed. LTX-2.3 with sound first (--size 22b,
# model.audio=true: 121 frames at 512x768 and 126 audio latents per clip, auto checkpointing at a
# 74 GiB budget), then Krea 2 (--size 12b, 1024^2) and Ideogram 4 (--size 9b-1024).
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
DEADLINE=$(( $(date +%s) + ${BUDGET:-200} ))
MIN_LEFT=40
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $LOG
L="train.precision=bf16 pipeline.micro_batches=2 pipeline.compile=true model.lora.rank=32 model.lora.alpha=32"
A="pipeline.activation_checkpointing=auto pipeline.memory_budget_gb=74"
SIZE=22b bench ltx23av 110 --warmup 1 --steps 2 \
  --run "lora-av: model=ltx23 model.audio=true pipeline=single $L $A"
SIZE=12b bench krea2 70 --warmup 1 --steps 2 --run "lora: model=krea2 pipeline=single $L"
SIZE=9b-1024 bench ideogram4 70 --warmup 1 --steps 2 --run "lora: model=ideogram4 pipeline=single $L"
