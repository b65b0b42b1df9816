#!/bin/bash
# For one H200 (eighth session wrote it; not yet run): the three families that got real-size
# benchmark configs in the eighth session, LoRA r32 at 1024x1024, 8 images per step, compiled,
# through the loader: Z-Image 6B, Lumina 2 (2.6B), Qwen-Image 20B. Their text is cut to the
# prompt (128 tokens), so no attention call is masked. dpipe-bench now also prints the executed
# TFLOP/s (docs/performance.md, "The convention counts more than runs"). ~8 minutes of device time.
REPO=$PWD
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
SIZE=6b
bench zimage 200 --warmup 2 --steps 3 --loader --run "z_image: model=z_image pipeline=single $L"
SIZE=2b
bench lumina2 150 --warmup 2 --steps 3 --loader --run "lumina2: model=lumina2 pipeline=single $L"
SIZE=20b
bench qwen 240 --warmup 2 --steps 3 --loader --run "qwen_image: model=qwen_image pipeline=single $L"
