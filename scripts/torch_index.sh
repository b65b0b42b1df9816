# The index `make setup` installs torch from (sourced by scripts/setup.sh).
#   choose_torch_index PYTHON REQUIREMENT  prints two lines: the index URL (empty: pip's own
#                                           indexes) and why, in words.
# PyPI's Linux torch is a multi-GB CUDA build: a machine with no NVIDIA driver gets the CPU
# build, unless pip's own indexes already give a CPU build (a local +cpu wheel, as on CI).
CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu

choose_torch_index() {
  local python=$1 requirement=$2 version
  if [ -n "${DPIPE_TORCH_INDEX:-}" ]; then
    printf '%s\n%s\n' "$DPIPE_TORCH_INDEX" "DPIPE_TORCH_INDEX is set"
    return
  fi
  if command -v nvidia-smi >/dev/null 2>&1 || [ -e /proc/driver/nvidia ]; then
    printf '\n%s\n' "an NVIDIA driver is present: pip's own index (PyPI's torch is a CUDA build)"
    return
  fi
  if [ "$(uname -s)" != Linux ]; then
    printf '\n%s\n' "not Linux: pip's own index (PyPI's torch here has no CUDA)"
    return
  fi
  # The version pip's own indexes would install, resolved without downloading it.
  version=$("$python" -m pip install --dry-run --quiet --no-deps --ignore-installed --report - \
    "$requirement" 2>/dev/null | "$python" -c '
import json, sys
try:
    print(json.load(sys.stdin)["install"][0]["metadata"]["version"])
except Exception:
    pass') || true
  if [[ "$version" == *+cpu ]]; then
    printf '\n%s\n' "no NVIDIA driver, and pip's own indexes give a CPU build ($version)"
    return
  fi
  printf '%s\n%s\n' "$CPU_TORCH_INDEX" \
    "no NVIDIA driver (no nvidia-smi, no /proc/driver/nvidia): the CPU build"
}
