#!/bin/bash
# Install a local single-node Slurm (Debian packages) for the test suite.
# Idempotent: returns at once when everything is already installed.
# Needs root (or passwordless sudo) and apt-get. Daemons are NOT started here
# (a policy-rc.d blocks the packages' init scripts); start.sh starts them.
set -euo pipefail

# iproute2 (`ip`): the two-node test bed's network namespaces (start.sh DPIPE_SLURM_NETNS_NODES)
PKGS=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server iproute2)

missing=()
for p in "${PKGS[@]}"; do
  st=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [ "$st" = "install ok installed" ] || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "slurm install: all packages already installed (${PKGS[*]})"
  exit 0
fi

SUDO=()
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then SUDO=(sudo -n); else
    echo "slurm install: ERROR: need root to install: ${missing[*]}" >&2; exit 1
  fi
fi
command -v apt-get >/dev/null || { echo "slurm install: ERROR: apt-get not found (Debian/Ubuntu only)" >&2; exit 1; }

t0=$(date +%s)
echo "slurm install: missing packages: ${missing[*]}"

# Keep package scripts from starting daemons (no systemd here; start.sh starts them).
POLICY=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$POLICY" ]; then
  echo "slurm install: writing $POLICY (exit 101: don't start services during install)"
  printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$POLICY" >/dev/null
  "${SUDO[@]}" chmod 755 "$POLICY"
  created_policy=1
fi
cleanup() { if [ "$created_policy" = 1 ]; then "${SUDO[@]}" rm -f "$POLICY"; fi; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
APT=("${SUDO[@]}" apt-get -y -q -o DPkg::Lock::Timeout=300 -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)

# apt-get update only when needed: no package lists, or the candidates are unknown.
need_update=0
for p in "${missing[@]}"; do
  cand=$(apt-cache policy "$p" 2>/dev/null | awk '/Candidate:/ {print $2}')
  if [ -z "$cand" ] || [ "$cand" = "(none)" ]; then need_update=1; break; fi
done
if [ "$need_update" = 1 ]; then
  echo "slurm install: apt-get update (package lists missing or stale)"
  "${SUDO[@]}" apt-get update -q
fi

echo "slurm install: apt-get install ${missing[*]}"
if ! "${APT[@]}" install --no-install-recommends "${missing[@]}"; then
  # stale lists can point at package versions that are gone from the mirror
  echo "slurm install: install failed; retrying after apt-get update"
  "${SUDO[@]}" apt-get update -q
  "${APT[@]}" install --no-install-recommends "${missing[@]}"
fi

for b in slurmctld slurmd slurmdbd sinfo munged mungekey mariadbd mariadb-install-db ip unshare nsenter; do
  command -v "$b" >/dev/null || { echo "slurm install: ERROR: $b not found after install" >&2; exit 1; }
done
echo "slurm install: done in $(( $(date +%s) - t0 )) s"
