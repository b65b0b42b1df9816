#!/usr/bin/env bash
# (scripts/test.sh does the same for `make test` when run as root.)
# CI: make sure a local SLURM can run here, then run the given command (e.g. `make test`) with
# DPIPE_REQUIRE_SLURM=1, so that the SLURM tests run instead of skipping. They start their own
# single-node SLURM for the session (scripts/slurm/start.sh) and stop it by PID at the end
# (scripts/slurm/stop.sh); nothing is left running.
#
# usage: bash scripts/ci_slurm.sh make test
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/slurm/install.sh   # root + apt; ~0.1 s when the packages are already there
export DPIPE_REQUIRE_SLURM=1
exec "$@"
