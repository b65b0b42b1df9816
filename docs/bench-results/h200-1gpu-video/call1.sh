#!/bin/bash
# Call 1 (one H200): Qwen-Image's host syncs after its RoPE tables move to the GPU once
# (compiled made 8 per step before), then HunyuanVideo 13B's per-layer times, LoRA and full.
D=$(cd "$(dirname "$0")" && pwd)
F=$D/../h200-1gpu-families/families.sh
MODELS=tiny_qwen_image,tiny_qwen_image_edit LIMIT=200 DPIPE_CACHE=/tmp/cache-q1 bash $F qwen-eager &
MODELS=tiny_qwen_image,tiny_qwen_image_edit LIMIT=200 DPIPE_CACHE=/tmp/cache-q2 bash $F qwen-compiled \
  pipeline.compile=true &
wait
cd $D/../../..
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
for mode in lora full; do
  extra="model.lora.rank=32 model.lora.alpha=32"
  [ $mode = full ] && extra="model.mode=full optim.master_weights=false"
  timeout 170 python3 -m dpipe.bench.layers --size 13b --out $OUT/layers-$mode.json \
    model=hunyuan_video pipeline.compile=true train.precision=bf16 $extra \
    > $OUT/layers-$mode.txt 2>&1
  echo "layers $mode rc=$?"; tail -14 $OUT/layers-$mode.txt
done
