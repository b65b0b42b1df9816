#!/bin/bash
# For the next session with one H200 (not yet run; after ../h200-1gpu-video/call3.sh): HiDream-I1
# at real size (17B, a 1024x1024 image), the first MoE family timed.
# 1. Each layer's time: do the modelled FLOPs (dpipe/models/hidream/costs.py: a dual block 0.96x
#    a single one) match, or does the MoE's routing by boolean indexing slow its feed-forward?
# 2. LoRA r32 on one GPU, compiled, 8 images per step. No --plain: diffusers' HiDream forward
#    outside training mode runs its experts under no_grad, so the plain loop would not train them.
REPO=$PWD
SIZE=i1
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
(cd $REPO && timeout 200 $PY -m dpipe.bench.layers --size i1 --out $OUT/layers-lora.json \
  model=hidream pipeline.compile=true train.precision=bf16 model.lora.rank=32 \
  model.lora.alpha=32 > $OUT/layers-lora.txt 2>&1; tail -10 $OUT/layers-lora.txt | tee -a $LOG)
bench lora1 330 --warmup 2 --steps 3 --loader --run "lora: model=hidream pipeline=single $L"
