#!/bin/bash
# Device call 2: the full fine-tune on one H200 without activation checkpointing (call 1's `auto`
# recomputed 5 of 59 layers although the plain loop fits without any), at 8 images per step and
# at 4 (each GPU's share of an 8-image step in a 2-GPU data-parallel run).
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
F="train.precision=bf16 pipeline.compile=true model.mode=full optim.master_weights=false"
bench fullnone8 280 --warmup 2 --steps 3 --loader --run "full-1gpu-none-8: pipeline=single $F pipeline.micro_batches=8"
bench fullnone4 250 --warmup 2 --steps 3 --loader --run "full-1gpu-none-4: pipeline=single $F pipeline.micro_batches=4"
