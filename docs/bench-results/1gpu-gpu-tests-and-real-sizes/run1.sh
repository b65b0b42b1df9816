#!/bin/bash
# Prepared 2026-12-05, not yet run (no device machine was lent that afternoon):
# (1) the GPU tests of block swap and fp8 compute, never run on a GPU before;
# (2) dpipe-bench at the released sizes, LoRA r32, 8 micro-batches, compiled, one GPU:
#     Krea 2 (--size 12b), Ideogram 4 (--size 9b-1024), LTX-2.3 (--size 22b), as far as the
#     call lasts (BUDGET seconds).
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
DEADLINE=$(( $(date +%s) + ${BUDGET:-480} ))
echo "=== gpu tests ($(date -u +%T))" | tee -a $LOG
(cd ../.. && timeout 300 $PY -m pytest -q -p no:cacheprovider tests/gpu/test_block_swap_gpu.py \
  tests/gpu/test_fp8_compute_gpu.py -rA 2>&1 | grep -v "Warning\|warn" | tail -40) \
  | tee $OUT/gpu-tests.txt | tee -a $LOG
SIZE=12b bench krea2 150 --warmup 1 --steps 2 --run "lora: model=krea2 pipeline=single $L"
SIZE=9b-1024 bench ideogram4 150 --warmup 1 --steps 2 --run "lora: model=ideogram4 pipeline=single $L"
SIZE=22b bench ltx23 200 --warmup 1 --steps 2 --run "lora: model=ltx23 pipeline=single $L"
