#!/bin/bash
# For a 2-GPU machine: target 2 by data parallelism (8 images per step, 4 on each GPU), and the
# 2-stage GPU test.
REPO=$PWD
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
F="train.precision=bf16 pipeline.compile=true model.mode=full optim.master_weights=false"
bench dpfull 330 --warmup 2 --steps 3 --loader --run "full-2gpu-data-parallel: pipeline=data_parallel $F pipeline.micro_batches=4"
(cd $REPO && timeout 150 $PY -m pytest tests/gpu -v -rs -k two_stage > $OUT/gpu-tests.txt 2>&1; echo "pytest rc=$?" >> $OUT/gpu-tests.txt)
tail -5 $OUT/gpu-tests.txt | tee -a $LOG
