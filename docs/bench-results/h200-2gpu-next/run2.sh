#!/bin/bash
# For a 2-GPU machine: target 2 by data parallelism (8 images per step, 4 on each GPU), and the
# LoRA data-parallel row again (16 images per step).
REPO=$PWD
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
F="train.precision=bf16 pipeline.compile=true model.mode=full optim.master_weights=false"
bench dpfull 330 --warmup 2 --steps 3 --loader --run "full-2gpu-data-parallel: pipeline=data_parallel $F pipeline.micro_batches=4"
bench dplora 240 --warmup 2 --steps 3 --loader --run "lora-2gpu-data-parallel: pipeline=data_parallel $L"
