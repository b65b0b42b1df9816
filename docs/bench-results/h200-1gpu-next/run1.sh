#!/bin/bash
# For a session with one H200 (not yet run): HiDream-I1 at real size (17B, a 1024x1024 image),
# LoRA r32 on one GPU, compiled, 8 images per step. Its per-layer times were measured in
# ../h200-1gpu-flex/call1-out (a dual block 1.083x a single one). No --plain: diffusers' HiDream
# forward outside training mode runs its experts under no_grad, so the plain loop would not
# train them.
REPO=$PWD
SIZE=i1
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
bench lora1 330 --warmup 2 --steps 3 --loader --run "lora: model=hidream pipeline=single $L"
