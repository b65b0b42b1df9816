#!/bin/bash
# For the next session with one H200 (~7 minutes; run it before next1.sh): HunyuanVideo 13B LoRA
# r32, compiled, 8 clips per step, as ../h200-1gpu-video/call2.sh ran it (18.786 s/step), now
# that make_inputs cuts the text padding (96 real of 256 tokens) and one clip per micro-batch
# leaves no mask: does SDPA's flash kernel bring the step to the ~10 s estimated in
# docs/performance.md? The plain loop still hands diffusers a (now all-true) mask.
REPO=$PWD
SIZE=13b
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
bench trimmed 440 --warmup 2 --steps 3 --loader --plain --run "lora: model=hunyuan_video pipeline=single $L"
