#!/bin/bash
# Device call 4 (lead, after the planner change): fp8 base weights under a 24 GiB cap with
# auto checkpointing planned for 24 GiB from the first step's measured peak, and with every
# layer recomputed, for the memory-vs-speed table.
source "$(dirname "$0")/common.sh"
bench fp8auto24 200 --warmup 2 --steps 3 --loader --memory-cap-gb 24 --run "lora-1gpu-fp8-auto-24GiB: pipeline=single $L model.base_dtype=fp8 pipeline.activation_checkpointing=auto pipeline.memory_budget_gb=24"
bench fp8all24 200 --warmup 2 --steps 3 --loader --memory-cap-gb 24 --run "lora-1gpu-fp8-all-24GiB: pipeline=single $L model.base_dtype=fp8 pipeline.activation_checkpointing=all"
