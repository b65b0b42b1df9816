#!/bin/bash
# Device call 1 (2026-12-01, third session; one H200): the GPU tests (host syncs audited, compiled
# = eager), each layer's forward and backward time at FLUX.1-dev size (full fine-tune and LoRA),
# and the first stage's backward as DeepSpeed ran it against one pass.
REPO=$PWD
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
echo "=== pytest tests/gpu ($(date -u +%T))" | tee -a $LOG
(cd $REPO && timeout 200 $PY -m pytest tests/gpu -v -rs --durations=0 \
  -k "host_sync or compiled_blocks" > $OUT/gpu-tests.txt 2>&1; echo "pytest rc=$?" >> $OUT/gpu-tests.txt)
tail -8 $OUT/gpu-tests.txt | tee -a $LOG
cd $REPO
echo "=== stage 0 backward ($(date -u +%T))" | tee -a $LOG
timeout 150 $PY docs/bench-results/h200-1gpu-stage/stage_backward.py 2>&1 | grep "stage0-backward\|Error\|error" | tee -a $LOG
for mode in full lora; do
  if [ $mode = full ]; then A="model.mode=full optim.master_weights=false"; else A="model.lora.rank=32 model.lora.alpha=32"; fi
  echo "=== layers $mode ($(date -u +%T))" | tee -a $LOG
  timeout 120 $PY -m dpipe.bench.layers --size dev --out $OUT/layers-$mode.json \
    pipeline.compile=true train.precision=bf16 $A 2>&1 | grep -v "WARNING" | tee $OUT/layers-$mode.txt | tail -5 | tee -a $LOG
done
echo "=== end ($(date -u +%T))" | tee -a $LOG
