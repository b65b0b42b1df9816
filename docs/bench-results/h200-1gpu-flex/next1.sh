#!/bin/bash
# For the next session with one H200 (~9 minutes): why FlexAttention compiles so slowly inside a
# HunyuanVideo 13B block (call 3: no first step within 80 s, against 20 s for sdpa and 6 s for
# flex alone), and what it gives once compiled. Each case's stacks land in $OUT/stacks/.
cd "$(dirname "$0")/../../.."
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles
B=docs/bench-results/h200-1gpu-flex/blocks.py
for c in sdpa:70 flex-isolated:150 compare:15 flex-dpipe:300 compare:15; do
  timeout ${c#*:} python3 $B ${c%%:*} /tmp/blocks 2>&1 | grep -v "Warning\|warn" | tail -12 | tee -a $OUT/blocks.txt
  echo "-- ${c%%:*} rc=${PIPESTATUS[0]}" | tee -a $OUT/blocks.txt
done
mkdir -p $OUT/stacks && cp /tmp/blocks/*.stacks.txt $OUT/stacks/
