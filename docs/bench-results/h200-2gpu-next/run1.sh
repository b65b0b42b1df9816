#!/bin/bash
# For a 2-GPU machine (not yet lent): targets 2 and 3 on 2 stages after the stage-engine fixes
# (one backward pass per stage, shapes between hosts, split by measured layer time: [29] full,
# [28] LoRA), and the 2-GPU tests (2-stage loss = 1-stage loss; no host sync in a 2-stage step).
REPO=$PWD
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
F="train.precision=bf16 pipeline.micro_batches=8 pipeline.compile=true model.mode=full optim.master_weights=false"
bench full2 270 --warmup 2 --steps 3 --loader --profile --run "full-2stage: pipeline=two_stage $F"
bench lora2 210 --warmup 2 --steps 3 --loader --profile --run "lora-2stage: pipeline=two_stage $L"
# --profile (eighth session): each stage's kernel time by kind, communication included.
for t in full2:full-2stage lora2:lora-2stage; do
  for r in 0 1; do cp /tmp/bench-${t%%:*}/${t##*:}/profile_rank$r.txt $OUT/${t%%:*}-profile_rank$r.txt 2>/dev/null; done
done
(cd $REPO && timeout 120 $PY -m pytest tests/gpu -v -rs -k two_stage > $OUT/gpu-tests.txt 2>&1; echo "pytest rc=$?" >> $OUT/gpu-tests.txt)
tail -5 $OUT/gpu-tests.txt | tee -a $LOG
