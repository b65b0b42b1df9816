#!/bin/bash
# For one H200 (eleventh session): Wan 2.1 14B LoRA, compiled, activation_checkpointing=auto and
# cuDNN's attention failed in its first backward with torch.utils.checkpoint's "Recomputed values
# ... have different metadata" (../h200-1gpu-next/call6-out). Which part is to blame: tiny Wan and
# tiny FLUX, compiled, checkpointed (auto with a budget that recomputes every layer after the
# probe, or all), with SDPA's default kernels and with cuDNN's; side by side.
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
cd ../..
go() {  # go TAG OVERRIDES...
  local tag=$1; shift
  TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-$tag timeout 300 $PY -m dpipe.cli.train hydra.run.dir=/tmp/ck-$tag \
    train.progress_bar=false dataset=synthetic train.precision=bf16 train.max_steps=3 \
    pipeline.micro_batches=2 train.checkpoint_every_steps=0 pipeline=single pipeline.compile=true "$@" \
    > $OUT/$tag.log 2>&1
  echo "$tag (rc $?): $* losses $(grep -o '"loss": [^,]*' /tmp/ck-$tag/metrics.jsonl 2>/dev/null | cut -c9-15 | tr '\n' ' ') $(grep -m1 -o 'CheckpointError.*' $OUT/$tag.log)"
}
AUTO="pipeline.activation_checkpointing=auto pipeline.memory_budget_gb=0.001"
for m in wan flux; do
  go $m-auto-sdpa model=tiny_$m $AUTO &
  go $m-auto-cudnn model=tiny_$m $AUTO model.attention=cudnn &
  go $m-all-sdpa model=tiny_$m pipeline.activation_checkpointing=all &
  go $m-all-cudnn model=tiny_$m pipeline.activation_checkpointing=all model.attention=cudnn &
done
wait
