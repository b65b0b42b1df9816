#!/bin/bash
# call.sh SECONDS SCRIPT... : runs the scripts in turn inside one device call of SECONDS; each
# bench is cut to the time left, and one that cannot start is skipped (common.sh, DEADLINE).
export DEADLINE=$(( $(date +%s) + $1 )); shift
for script in "$@"; do bash "$script"; done
