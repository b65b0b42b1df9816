#!/bin/bash
# Device call 3: does `auto` checkpointing's plan hold for a full fine-tune (resident weights,
# gradients and AdamW states 88.8 GiB) when memory is short? A 100 GiB budget under a hard
# 100 GiB cap, and every layer recomputed under the same cap for comparison.
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
F="train.precision=bf16 pipeline.compile=true model.mode=full optim.master_weights=false pipeline.micro_batches=8"
bench fullauto100 300 --warmup 2 --steps 3 --loader --memory-cap-gb 100 --run "full-1gpu-auto-100GiB: pipeline=single $F pipeline.activation_checkpointing=auto pipeline.memory_budget_gb=100"
bench fullall100 250 --warmup 2 --steps 3 --loader --memory-cap-gb 100 --run "full-1gpu-all-100GiB: pipeline=single $F pipeline.activation_checkpointing=all"
