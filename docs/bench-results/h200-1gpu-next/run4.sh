#!/bin/bash
# For one H200 (eighth session wrote it; not yet run): HunyuanVideo 1.5 (8.3B) LoRA r32 on a
# 33-frame 480x832 clip (14040 video tokens), 8 clips per step, compiled, through the loader;
# its text is cut to the prompt and the 729 SigLIP tokens are dropped, so no attention call is
# masked (docs/models.md). ~6 minutes of device time.
REPO=$PWD
SIZE=8b
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
bench hv15 330 --warmup 2 --steps 3 --loader --run "hv15: model=hunyuan_video15 pipeline=single $L"
