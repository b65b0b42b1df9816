#!/bin/bash
# run1.sh again with dpipe's sync-free MoE (dpipe/models/hidream/moe.py): run1 made 7296 host syncs
# per step (diffusers' MoE picks each expert's tokens by a boolean mask) and ran at 13% MFU.
# The seventh session ran it with 185 s, one warm-up and two timed steps: no step had ended by
# then (run2-out/log.txt), so it is given 400 s here (~8 minutes of device time in all).
REPO=$PWD
SIZE=i1
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
bench lora2 400 --warmup 2 --steps 3 --loader --run "lora: model=hidream pipeline=single $L"
