#!/bin/bash
# Device call 1 (2026-12-04): optimizer memory. (1) scripts/bench_optimizers.py: state bytes and
# step time of every optim=<name> on a 1.8 B-parameter stack of DiT-shaped bf16 weights;
# (2) dpipe-bench: a full fine-tune of FLUX.1-dev (random weights) on ONE H200 with bf16 weights
# and states (optim.master_weights=false), no activation checkpointing, 8 images per step, with
# optim=adamw, adamw8bit and adafactor: peak memory and s/step.
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
echo "=== bench_optimizers ($(date -u +%T))" | tee -a $LOG
timeout 150 $PY ../../scripts/bench_optimizers.py --width 3072 --blocks 16 --dtype bf16 2>&1 \
  | grep -v "^WARNING" | tee $OUT/bench_optimizers.txt | tee -a $LOG
F="train.precision=bf16 pipeline.compile=true model.mode=full optim.master_weights=false pipeline=single pipeline.micro_batches=8 pipeline.activation_checkpointing=none"
bench fullopt 420 --warmup 2 --steps 3 \
  --run "full-adamw: $F optim=adamw" \
  --run "full-adamw8bit: $F optim=adamw8bit" \
  --run "full-adafactor: $F optim=adafactor"
# The GPU training path with bitsandbytes installed (the fork server must not start CUDA), and
# the 8-bit optimizer on CUDA through dpipe-train.
echo "=== pytest tests/gpu ($(date -u +%T))" | tee -a $LOG
(cd .. && cd .. && timeout 150 $PY -m pytest tests/gpu/test_gpu.py -q -x -p no:cacheprovider \
  -k "one_gpu_step_makes_no_host_sync" > $OUT/gpu-tests.txt 2>&1; echo "pytest rc=$?" >> $OUT/gpu-tests.txt)
tail -4 $OUT/gpu-tests.txt | tee -a $LOG
(cd ../.. && rm -rf /tmp/o8 && timeout 120 $PY -m dpipe.cli.train hydra.run.dir=/tmp/o8 \
  train.progress_bar=false optim=adamw8bit train.max_steps=4 pipeline=single > $OUT/adamw8bit-train.txt 2>&1; \
  echo "rc=$?" >> $OUT/adamw8bit-train.txt; tail -c 1500 /tmp/o8/metrics.jsonl >> $OUT/adamw8bit-train.txt)
tail -5 $OUT/adamw8bit-train.txt | tee -a $LOG
