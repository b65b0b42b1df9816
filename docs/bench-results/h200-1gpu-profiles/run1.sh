#!/bin/bash
# For one H200 (ninth session): where Qwen-Image 20B's and HunyuanVideo 1.5's LoRA steps spend
# their time. Counted in executed FLOPs (fixed in this session: the meta count had failed for
# both), Qwen-Image runs at ~28% of the bf16 peak and HunyuanVideo 1.5 at ~38%, FLUX.1-dev at
# 45%. Each: the benchmark's LoRA r32 step (8 samples, compiled, loader) with --profile, the
# kernel time by kind in <tag>-profile.txt; first SDPA's kernels at the three attention shapes
# (sdpa.py). ~9 minutes of device time: run as
# `../h200-1gpu-loader-fp8/call.sh 580 run1.sh`.
REPO=$PWD
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../h200-1gpu-loader-fp8/common.sh"
$PY $HERE/sdpa.py 2>&1 | tee -a $LOG
SIZE=20b
bench qwen 270 --warmup 2 --steps 2 --loader --profile --run "qwen: model=qwen_image pipeline=single $L"
cp /tmp/bench-qwen/qwen/profile_rank0.txt $OUT/qwen-profile.txt 2>/dev/null
SIZE=8b
bench hv15 300 --warmup 2 --steps 2 --loader --profile --run "hv15: model=hunyuan_video15 pipeline=single $L"
cp /tmp/bench-hv15/hv15/profile_rank0.txt $OUT/hv15-profile.txt 2>/dev/null
head -30 $OUT/*-profile.txt | tee -a $LOG
