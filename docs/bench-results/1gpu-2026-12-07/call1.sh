#!/bin/bash
# Device call 1 (2026-12-07, one GPU): the GPU tests changed on 2026-12-06 (the corrected fp8
# gradient test, the one-stage default pipeline), tiny LTX-2.3 with sound compiled (its host
# syncs after the AVState and head fixes), then LTX-2.3 22B with sound (--size 22b: 121 frames at
# 512x768 and 126 audio latents per clip), LoRA r32, 8 micro-batches, compiled, auto checkpointing
# at a 74 GiB budget. call2.sh runs the same without sound on the same machine.
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
DEADLINE=$(( $(date +%s) + ${BUDGET:-570} ))
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $LOG
echo "=== GPU tests ($(date -u +%T))" | tee -a $LOG
(cd ../.. && timeout 150 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_base_compute_gpu.py -k fp8 \
  "tests/gpu/test_gpu.py::test_the_default_pipeline_runs_one_stage_on_one_gpu" 2>&1 \
  | grep -E "assert|passed|failed|Error|skipped" | head -30) | tee -a $LOG
SIZE=tiny bench ltxav-tiny 70 --warmup 2 --steps 1 \
  --run "av: model=tiny_ltx23 model.audio=true pipeline=single train.precision=bf16 pipeline.micro_batches=4 pipeline.compile=true"
A="pipeline.activation_checkpointing=auto pipeline.memory_budget_gb=74"
SIZE=22b bench ltx23av 360 --warmup 1 --steps 1 \
  --run "lora-av: model=ltx23 model.audio=true pipeline=single $L $A"
