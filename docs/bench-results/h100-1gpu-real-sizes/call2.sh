#!/bin/bash
# Device call 2 (2026-12-06, one H100): LTX-2.3 video only at its released size (as call 1's,
# model.audio=false); the flux_lora_24gb preset under a hard 24 GiB allocation cap (an emulated
# 24 GB card); the GPU tests of block swap and fp8 compute.
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
DEADLINE=$(( $(date +%s) + ${BUDGET:-570} ))
A="pipeline.activation_checkpointing=auto pipeline.memory_budget_gb=74"
SIZE=22b bench ltx23 240 --warmup 2 --steps 2 --run "lora: model=ltx23 pipeline=single $L $A"
SIZE=dev bench flux24 180 --warmup 2 --steps 2 --memory-cap-gb 24 \
  --run "flux_lora_24gb: experiment=flux_lora_24gb $L"
echo "=== gpu tests ($(date -u +%T))" | tee -a $LOG
left=$(( DEADLINE - $(date +%s) ))
(cd ../.. && timeout $left $PY -m pytest -q -p no:cacheprovider tests/gpu/test_block_swap_gpu.py \
  tests/gpu/test_base_compute_gpu.py -k fp8 -rA 2>&1 | grep -v "Warning\|warn" | tail -40) \
  | tee $OUT/gpu-tests.txt | tee -a $LOG
