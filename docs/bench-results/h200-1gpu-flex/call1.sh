#!/bin/bash
# Call 1 of this session (one H200): why FlexAttention never finished in call 3, then HiDream-I1
# 17B per-layer times (the first half of ../h200-1gpu-next/run1.sh).
REPO=$PWD
SIZE=i1
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
(cd $REPO && timeout 170 $PY docs/bench-results/h200-1gpu-flex/flex_compile.py \
  > $OUT/flex-compile.txt 2>&1; echo "rc=$?" >> $OUT/flex-compile.txt; grep -- "^--\|^13B\|^torch\|^rc" $OUT/flex-compile.txt)
(cd $REPO && timeout 200 $PY -m dpipe.bench.layers --size i1 --out $OUT/layers-lora.json \
  model=hidream pipeline.compile=true train.precision=bf16 model.lora.rank=32 \
  model.lora.alpha=32 > $OUT/layers-lora.txt 2>&1; echo "rc=$?" >> $OUT/layers-lora.txt; tail -12 $OUT/layers-lora.txt | tee -a $LOG)
