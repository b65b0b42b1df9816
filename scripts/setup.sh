#!/usr/bin/env bash
# Creates .venv with dpipe and its dependencies; fast when nothing changed.
#   DPIPE_TORCH        the torch requirement installed first (default: torch==2.13.0, the version
#                      CI tests on).
#   DPIPE_TORCH_INDEX  the index torch comes from. It picks the build:
#                        CPU only:  DPIPE_TORCH_INDEX=https://download.pytorch.org/whl/cpu
#                        CUDA GPU:  DPIPE_TORCH_INDEX=https://download.pytorch.org/whl/cu130
#                                   (the cuXYZ of your driver's CUDA; pytorch.org lists them)
#                      Default: pip's own (from PyPI on Linux, the CUDA build, several GB); on
#                      Linux with no NVIDIA driver, the CPU index (scripts/torch_index.sh).
# Torch is installed only into a .venv without one: to change the build, remove .venv first.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
"$PYTHON" - <<'PY' || { echo "dpipe needs Python >= 3.10 (found $("$PYTHON" --version 2>&1))" >&2; exit 1; }
import sys; sys.exit(sys.version_info < (3, 10))
PY

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi

stamp=.venv/.dpipe-setup
want=$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

# torch first: an unpinned torch pulled in by deepspeed/peft would be a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  torch_req=${DPIPE_TORCH:-torch==2.13.0}
  source scripts/torch_index.sh
  { read -r index; read -r why; } < <(choose_torch_index .venv/bin/python "$torch_req")
  torch_index=()
  [ -n "$index" ] && torch_index=(--index-url "$index")
  echo "[setup] installing $torch_req from ${index:-the default index}: $why"
  .venv/bin/python -m pip install -q "${torch_index[@]}" "$torch_req"
fi
echo "[setup] installing dpipe and its dependencies"
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
# DeepSpeed logs its accelerator choice on import: shown only when the import fails.
if ! .venv/bin/python -c "import dpipe, deepspeed, diffusers, hydra" >/dev/null 2>&1; then
  .venv/bin/python -c "import dpipe, deepspeed, diffusers, hydra"
  echo "[setup] the install failed; see the messages above" >&2
  exit 1
fi
echo "$want" > "$stamp"
echo "[setup] ready: $(.venv/bin/python -c 'import torch, deepspeed, diffusers; print(f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, diffusers {diffusers.__version__}")' 2>/dev/null | tail -n 1)"
