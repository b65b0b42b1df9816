#!/bin/bash
# Call 2 (one H200): HunyuanVideo at real size (13B, a 33-frame
# 512x512 clip: 9216 video + 256 text tokens), the first family after FLUX with benchmark configs.
# 1. Each layer's time (does a double-stream block cost what a single-stream one does, as
#    `block_costs` assumes?), and the split that balances them.
# 2. LoRA r32 on one GPU, compiled, 8 clips per step, and the plain loop beside it.
REPO=$PWD
SIZE=13b
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
(cd $REPO && timeout 200 $PY -m dpipe.bench.layers --size 13b --out $OUT/layers-lora.json \
  model=hunyuan_video pipeline.compile=true train.precision=bf16 model.lora.rank=32 \
  model.lora.alpha=32 > $OUT/layers-lora.txt 2>&1; tail -8 $OUT/layers-lora.txt | tee -a $LOG)
bench lora1 330 --warmup 2 --steps 3 --loader --plain --run "lora: model=hunyuan_video pipeline=single $L"
