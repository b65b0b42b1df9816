#!/bin/bash
# For one H200 (twelfth session): run6.sh's half did not end within a call (its two compiled
# sweeps ran one after the other). The test now sweeps the two modes it compares side by side;
# here on 8 families of the kinds users train most, compiled, default kernels vs cuDNN's, then
# each run's losses (kept in /tmp/fam7 whether or not pytest ends). Run through call.sh.
source "$(dirname "$0")/../h200-1gpu-loader-fp8/common.sh"
R=$OUT/compiled.txt
export GPU_FAMILIES=${GPU_FAMILIES:-tiny_flux,tiny_wan,tiny_hunyuan_video,tiny_qwen_image,tiny_flux2,tiny_ltx_video,tiny_sd3,tiny_hunyuan_video15}
echo "families: $GPU_FAMILIES" | tee $R
(cd ../.. && timeout $(( DEADLINE - $(date +%s) - 20 )) $PY -m pytest -q -p no:cacheprovider -rf \
  --basetemp=/tmp/fam7 tests/gpu/test_families_gpu.py -k "cudnn-compiled" 2>&1 | tail -30) | tee -a $R
python3 - <<'PY' | tee -a $R
import json, pathlib, collections
rows = collections.defaultdict(dict)
for m in sorted(pathlib.Path("/tmp/fam7").glob("*/**/metrics.jsonl")):
    mode = next(p.name.rsplit("-", 1)[0] for p in m.parents if p.parent.name == "fam7")
    model = next(o for o in (m.parent / ".hydra/overrides.yaml").read_text().split() if "model=" in o)
    rows[model.split("=")[1]][mode] = [(round(r["loss"], 5), r.get("host_syncs")) for r in map(json.loads, m.read_text().splitlines())]
for model, modes in rows.items():
    print(f"{model:28s} " + "  ".join(f"{k} {v}" for k, v in sorted(modes.items())))
PY
