#!/bin/bash
# For one H200 (eighth session wrote it; not yet run): Wan 2.1 T2V 14B LoRA r32 on a 33-frame
# 480x832 clip (14040 video tokens, 512 text tokens), 8 clips per step, compiled, through the
# loader, with `auto` activation checkpointing (the activations of 8 such clips likely pass the
# H200's memory without it). ~8 minutes of device time. Eleventh session: with cuDNN's attention
# kernel, its NaN fixed (docs/bench-results/h200-1gpu-cudnn-nan).
REPO=$PWD
SIZE=14b
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
bench wan 450 --warmup 2 --steps 3 --loader --run "wan: model=wan pipeline=single $L pipeline.activation_checkpointing=auto model.attention=cudnn"
