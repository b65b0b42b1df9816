#!/bin/bash
# For one H200 (eighth session wrote it; not yet run): where FLUX.1-dev's LoRA step spends the
# time it does not spend at the matmul peak (45% in executed FLOPs, docs/performance.md): the
# target-1 configuration with --profile, one more step under torch.profiler whose kernel time
# is summed by kind (profile_rank0.txt). Also the first GPU run of the executed-TFLOP/s column.
# ~4 minutes of device time.
REPO=$PWD
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
bench lora-profile 300 --warmup 2 --steps 3 --loader --profile --run "lora: pipeline=single $L"
cp /tmp/bench-lora-profile/lora/profile_rank0.txt $OUT/ 2>/dev/null
cat $OUT/profile_rank0.txt | head -40 | tee -a $LOG
