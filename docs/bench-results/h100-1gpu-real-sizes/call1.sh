#!/bin/bash
# Device call 1 (2026-12-06, one H100): (1) the GPU tests of block swap and fp8 compute;
# (2) dpipe-bench at the released sizes, LoRA r32, 8 micro-batches, compiled, one GPU,
#     activation_checkpointing=auto at a 74 GiB budget (layers recomputed only where needed):
#     Krea 2 (--size 12b, 1024^2), Ideogram 4 (--size 9b-1024).
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
DEADLINE=$(( $(date +%s) + ${BUDGET:-570} ))
A="pipeline.activation_checkpointing=auto pipeline.memory_budget_gb=74"
echo "=== gpu tests ($(date -u +%T))" | tee -a $LOG
(cd ../.. && timeout 200 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_block_swap_gpu.py \
  tests/gpu/test_fp8_compute_gpu.py -rA 2>&1 | grep -v "Warning\|warn" | tail -40) \
  | tee $OUT/gpu-tests.txt | tee -a $LOG
SIZE=12b bench krea2 190 --warmup 2 --steps 2 --run "lora: model=krea2 pipeline=single $L $A"
SIZE=9b-1024 bench ideogram4 190 --warmup 2 --steps 2 --run "lora: model=ideogram4 pipeline=single $L $A"
