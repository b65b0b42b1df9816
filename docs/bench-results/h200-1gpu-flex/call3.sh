#!/bin/bash
# Call 3 of this session (one H200, the last ~4 minutes of device time): one real-size
# HunyuanVideo double and single block under the three attention paths of blocks.py.
cd "$(dirname "$0")/../../.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
B=docs/bench-results/h200-1gpu-flex/blocks.py
for c in flex-dpipe:80 sdpa:70 compare:15 flex-diffusers:50 compare:15; do
  timeout ${c#*:} python3 $B ${c%%:*} /tmp/blocks 2>&1 | grep -v "Warning\|warn" | tail -6 | tee -a $OUT/blocks.txt
  echo "-- ${c%%:*} rc=${PIPESTATUS[0]}" | tee -a $OUT/blocks.txt
done
