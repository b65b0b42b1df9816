#!/bin/bash
# Device call 1 (2026-12-06, one H100): the fp8 gradient test and its diagnosis, the host syncs of
# tiny LTX-2.3 with and without sound (where they come from), the flux_lora_16gb preset under a
# 16 GiB cap after the block-swap fix, then the tiny families' host syncs on a GPU.
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
DEADLINE=$(( $(date +%s) + ${BUDGET:-570} ))
cd ../.. 
echo "=== fp8 grad test ($(date -u +%T))" | tee -a $LOG
timeout 120 $PY -m pytest -q -p no:cacheprovider -x tests/gpu/test_base_compute_gpu.py -k fp8 2>&1 | grep -E "assert|passed|failed|Error" | head -20 | tee -a $LOG
cd docs/bench-results
for c in "false" "true"; do
  SIZE=tiny bench ltxav-tiny-compile-$c 120 --warmup 1 --steps 1 \
    --run "av: model=tiny_ltx23 model.audio=true pipeline=single train.precision=bf16 pipeline.micro_batches=4 pipeline.compile=$c"
  SIZE=tiny bench ltx-tiny-compile-$c 120 --warmup 1 --steps 1 \
    --run "v: model=tiny_ltx23 pipeline=single train.precision=bf16 pipeline.micro_batches=4 pipeline.compile=$c"
done
SIZE=dev bench flux16 200 --warmup 1 --steps 2 --memory-cap-gb 16 \
  --run "flux_lora_16gb: experiment=flux_lora_16gb $L"
cd ../..
echo "=== tiny families, 2 steps each, host syncs of step 2 ($(date -u +%T))" | tee -a $LOG
left=$(( DEADLINE - $(date +%s) - 5 ))
MODELS=$(ls conf/model/ | grep ^tiny_ | sed 's/.yaml//' | paste -sd,)
timeout $left $PY -m dpipe.cli.train -m model=$MODELS dataset=synthetic pipeline=single \
  train.max_steps=2 train.checkpoint_every_steps=0 train.progress_bar=false sample=none \
  train.precision=bf16 hydra.sweep.dir=/tmp/syncs > /tmp/syncs.log 2>&1
grep -h "host syncs\|Launching\|#[0-9]* :" /tmp/syncs.log | tee $OUT/tiny-syncs.txt | tail -80
grep -rh "host syncs" /tmp/syncs --include=*.log | sort | uniq -c | sort -rn | head -60 > $OUT/tiny-syncs-logs.txt
