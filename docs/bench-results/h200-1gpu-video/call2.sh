#!/bin/bash
# Call 2 (one H200): HunyuanVideo at real size (13B, a 33-frame
# 512x512 clip: 9216 video + 256 text tokens), the first family after FLUX with benchmark configs.
# 1. Which attention backend runs its text-padding mask fastest (attention.py).
# 2. LoRA r32 on one GPU, compiled, 8 clips per step, and the plain loop beside it.
REPO=$PWD
SIZE=13b
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
(cd $REPO && timeout 100 $PY docs/bench-results/h200-1gpu-video/attention.py 2>&1 \
  | grep -v Warning | tee $OUT/attention.txt)
bench lora1 440 --warmup 2 --steps 3 --loader --plain --run "lora: model=hunyuan_video pipeline=single $L"
