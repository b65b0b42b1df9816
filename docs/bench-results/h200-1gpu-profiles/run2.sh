#!/bin/bash
# For one H200 (ninth session): cuDNN's attention, checked and timed. cudnn_check.py compares its
# output and gradients with an fp32 reference at tiny and real shapes, eager and compiled; then
# FLUX.1-dev's LoRA step (target 1) with model.attention=cudnn beside the plain loop using the
# same kernel (--plain), and HunyuanVideo 1.5's LoRA step, 70% of whose kernel time was flash
# attention (run1). ~10 minutes: `../h200-1gpu-loader-fp8/call.sh 580 run2.sh`.
REPO=$PWD
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../h200-1gpu-loader-fp8/common.sh"
timeout 120 $PY $HERE/cudnn_check.py 2>&1 | grep -v Warning | tee -a $LOG
bench flux-cudnn 260 --warmup 2 --steps 3 --loader --plain --run "lora: pipeline=single $L model.attention=cudnn"
SIZE=8b
bench hv15-cudnn 300 --warmup 2 --steps 2 --loader --run "hv15: model=hunyuan_video15 pipeline=single $L model.attention=cudnn"
