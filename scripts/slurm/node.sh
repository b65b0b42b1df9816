#!/bin/bash
# One node of a several-node local Slurm (start.sh with DPIPE_SLURM_NETNS_NODES): start its slurmd
# inside its network namespace, or take the node down as a crash does.
#
# usage: node.sh ROOT NODE start    slurmd -D in the node's namespace (its link up), PID in
#                                   ROOT/pids/slurmd.NODE.pid; returns once it runs (slurmctld
#                                   sees the node back within seconds: ReturnToService=2)
#        node.sh ROOT NODE crash    the node's link down (its peers hear nothing more, as from a
#                                   dead machine), then KILL every process in its namespace:
#                                   slurmd, job steps (slurmstepd) and the tasks they run
set -euo pipefail
if [ $# -ne 3 ]; then echo "usage: $0 ROOT NODE start|crash" >&2; exit 2; fi
ROOT=$(cd "$1" && pwd -P)
NODE=$2
[ -f "$ROOT/netns" ] || { echo "slurm node: ERROR: $ROOT/netns missing: not a several-node cluster (DPIPE_SLURM_NETNS_NODES)" >&2; exit 2; }
# shellcheck disable=SC1091
. "$ROOT/netns"
case " $NODES " in *" $NODE "*) ;; *) echo "slurm node: ERROR: no node $NODE (nodes: $NODES)" >&2; exit 2 ;; esac
K=${NODE#node}
NS=${NS_PREFIX}n$K
VETH=${VETH_PREFIX}n$K
PIDFILE=$ROOT/pids/slurmd.$NODE.pid
CONF=$ROOT/etc/slurm.conf

running() {
  local st
  st=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  st=${st##*) }
  [ "${st%% *}" != Z ]
}

case "$3" in
  start)
    ip link set "$VETH" up
    mkdir -p "$ROOT/state/d/$NODE"
    # nsenter --net is `ip netns exec` without its fresh /sys mount, which would hide the
    # /sys/fs/cgroup that slurmd insists on. nsenter, unshare (no --fork) and sh's exec keep one
    # PID: the recorded one is slurmd's.
    SLURM_CONF=$CONF setsid nsenter --net="/run/netns/$NS" unshare --uts sh -c 'hostname "$0" && exec slurmd -D -f "$1" -N "$0"' \
      "$NODE" "$CONF" < /dev/null > "$ROOT/log/slurmd.$NODE.out" 2>&1 &
    pid=$!
    echo "$pid" > "$PIDFILE"
    for _ in $(seq 1 100); do
      [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = slurmd ] && break
      running "$pid" || { echo "slurm node: ERROR: slurmd of $NODE exited:" >&2; cat "$ROOT/log/slurmd.$NODE.out" >&2; exit 1; }
      sleep 0.05
    done
    echo "slurm node: $NODE: slurmd pid $pid in namespace $NS"
    ;;
  crash)
    ip link set "$VETH" down
    pids=$(ip netns pids "$NS" | tr '\n' ' ')
    # shellcheck disable=SC2086
    [ -z "${pids// /}" ] || kill -KILL $pids 2>/dev/null || true
    for _ in $(seq 1 100); do
      left=0
      for p in $pids; do running "$p" && left=1; done
      [ "$left" = 0 ] && break
      sleep 0.05
    done
    rm -f "$PIDFILE"
    echo "slurm node: $NODE crashed: link $VETH down, killed $(echo $pids | wc -w) processes ($pids)"
    ;;
  *) echo "usage: $0 ROOT NODE start|crash" >&2; exit 2 ;;
esac
