#!/bin/bash
# Call 1: every tiny family on one GPU, eager (all) and compiled (two halves at once).
D=$(dirname "$0")
ALL=$(python3 -c "from tests.integration.test_families import FAMILIES; print(','.join(FAMILIES))")
A=$(echo $ALL | cut -d, -f1-11); B=$(echo $ALL | cut -d, -f12-)
LIMIT=540 bash $D/families.sh eager &
MODELS=$A LIMIT=540 DPIPE_CACHE=/tmp/cache-a bash $D/families.sh compiled-a pipeline.compile=true &
MODELS=$B LIMIT=540 DPIPE_CACHE=/tmp/cache-b bash $D/families.sh compiled-b pipeline.compile=true &
wait
