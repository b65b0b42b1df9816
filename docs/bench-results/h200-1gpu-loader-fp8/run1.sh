#!/bin/bash
# Device call 1: LoRA r32 1 GPU compiled: the new loader, fixed
# batches (same machine, for the comparison), and fp8 base weights with no checkpointing.
source "$(dirname "$0")/common.sh"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $PY -c "import torch, peft, diffusers, deepspeed; print(torch.__version__, peft.__version__, diffusers.__version__, deepspeed.__version__)"
} 2>&1 | grep -v WARNING | tee -a $LOG
bench loader 200 --warmup 2 --steps 3 --loader --run "lora-1gpu-compiled-loader: pipeline=single $L"
bench fixed 175 --warmup 2 --steps 3 --run "lora-1gpu-compiled-fixed: pipeline=single $L"
bench fp8none 190 --warmup 2 --steps 3 --loader --run "lora-1gpu-fp8-compiled: pipeline=single $L model.base_dtype=fp8"
