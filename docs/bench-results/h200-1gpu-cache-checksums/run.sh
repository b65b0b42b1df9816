#!/bin/bash
# One device call: what reading a step's cache entries costs with their CRC-32 checked
# (scripts/bench_cache_reads.py, one core), and FLUX.1-dev LoRA r32 on 1 GPU, compiled, through
# the loader (its workers read and verify the step's entries from a cache store) against fixed
# batches on the same machine.
source "$(dirname "$0")/common.sh"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  lscpu | grep -E "^Model name|^CPU\(s\)"
  for i in 1 2; do PYTHONPATH=. $PY scripts/bench_cache_reads.py; done
} 2>&1 | grep -v WARNING | tee -a $LOG
bench loader 200 --warmup 2 --steps 4 --loader --run "lora-1gpu-compiled-loader: pipeline=single $L"
bench fixed 160 --warmup 2 --steps 4 --run "lora-1gpu-compiled-fixed: pipeline=single $L"
