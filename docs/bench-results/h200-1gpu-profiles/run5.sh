#!/bin/bash
# For one H200 (written in the twelfth session, not yet run): which kernel compiled code runs
# under cuDNN-first flags at the tiny models' shapes. Compiled, tiny FLUX.1 / Flux 2 / Wan gave
# the default kernels' losses to five digits with model.attention=cudnn (eager they differed),
# so cuDNN may decline head dim 16 there. Tiny FLUX: 2 heads of 16, 64 image + 32 text tokens.
# ~3 minutes.
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../h200-1gpu-loader-fp8/common.sh"
cd ../..
for shape in 1,96,2,16 2,96,2,16 1,96,2,64 1,4608,24,128; do
  for order in flash cudnn; do
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-shapes timeout 90 $PY $HERE/sdpa_cache.py --dpipe \
      --shape $shape $order 2>&1 | grep -v -i warn | tee -a $OUT/shapes.txt
  done
done
# The same question inside the training path: one profiled step of the tiny FLUX model,
# compiled, per kernel choice; its top kernels name the attention kernels that ran.
for kernel in sdpa cudnn; do
  timeout 150 $PY -m dpipe.cli.bench --size tiny --warmup 1 --steps 1 --profile --out /tmp/tiny-$kernel \
    --run "tiny-$kernel: pipeline=single train.precision=bf16 pipeline.micro_batches=2 pipeline.compile=true model.attention=$kernel" \
    > /tmp/tiny-$kernel.log 2>&1
  echo "--- tiny FLUX compiled, model.attention=$kernel: attention kernels in the profile" | tee -a $OUT/shapes.txt
  grep -h -i "attention |" /tmp/tiny-$kernel/*/profile_rank0.txt | tee -a $OUT/shapes.txt
  grep -h "attention " /tmp/tiny-$kernel/*/profile_rank0.txt | head -1 | tee -a $OUT/shapes.txt
done
