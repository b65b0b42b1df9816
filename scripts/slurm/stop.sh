#!/bin/bash
# Stop the Slurm daemons that start.sh ROOT started, by the PIDs in ROOT/pids
# (TERM, wait, then KILL). Jobs still queued or running are cancelled first, and
# any job step left behind (slurmstepd with this ROOT's SLURM_CONF) is killed. With nodes in
# network namespaces (start.sh's DPIPE_SLURM_NETNS_NODES), whatever still runs in them is killed
# and the namespaces, their links and the bridge are removed (ROOT/netns lists them).
# Never touches processes it did not start.
#
# usage: stop.sh ROOT     env: DPIPE_SLURM_STOP_WAIT seconds per daemon before KILL (default 10)
set -euo pipefail

if [ $# -ne 1 ] || [ -z "$1" ]; then echo "usage: $0 ROOT" >&2; exit 2; fi
if [ ! -d "$1" ]; then echo "slurm stop: $1 does not exist: nothing to stop"; exit 0; fi
ROOT=$(cd "$1" && pwd -P)
PIDS=$ROOT/pids
CONF=$ROOT/etc/slurm.conf
WAIT=${DPIPE_SLURM_STOP_WAIT:-10}
case "$WAIT" in ""|*[!0-9]*) echo "slurm stop: ERROR: DPIPE_SLURM_STOP_WAIT must be an integer" >&2; exit 2 ;; esac
log() { echo "slurm stop: $*"; }

if [ ! -d "$PIDS" ]; then log "no $PIDS: nothing to stop"; exit 0; fi

# running PID: alive and not a zombie (an exited daemon stays a zombie until init reaps it)
running() {
  local st
  st=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  st=${st##*) }
  [ "${st%% *}" != Z ]
}

# pid_of NAME: the recorded PID if that process is still alive and still is NAME (slurmd.node2:
# a slurmd)
pid_of() {
  local f=$PIDS/$1.pid pid comm
  [ -f "$f" ] || return 1
  pid=$(tr -dc 0-9 < "$f")
  [ -n "$pid" ] && running "$pid" || return 1
  comm=$(cat "/proc/$pid/comm" 2>/dev/null || true)
  if [ "$comm" != "${1%%.*}" ]; then
    log "pid $pid in $f is now '$comm', not $1: not touching it" >&2
    return 1
  fi
  echo "$pid"
}

# 1. cancel the jobs (slurmd does not take running jobs down with it), remember the next job id
if pid_of slurmctld >/dev/null && [ -f "$CONF" ]; then
  export SLURM_CONF=$CONF
  scontrol show config 2>/dev/null | awk '$1 == "NEXT_JOB_ID" {print $3}' > "$ROOT/state/next_job_id.tmp" \
    && [ -s "$ROOT/state/next_job_id.tmp" ] && mv "$ROOT/state/next_job_id.tmp" "$ROOT/state/next_job_id" || true
  rm -f "$ROOT/state/next_job_id.tmp"
  jobs=$(timeout 10 squeue -h -o %A 2>/dev/null | tr '\n' ' ' || true)
  if [ -n "${jobs// /}" ]; then
    log "cancelling jobs: $jobs"
    # shellcheck disable=SC2086
    timeout 10 scancel $jobs 2>/dev/null || true
    for _ in $(seq 1 $((WAIT * 5))); do
      [ -z "$(timeout 5 squeue -h -o %A 2>/dev/null || true)" ] && break
      sleep 0.2
    done
  fi
fi

# 2. the daemons, in reverse start order
stop_one() {
  local name=$1 pid t0
  pid=$(pid_of "$name") || { rm -f "$PIDS/$name.pid"; return 0; }
  t0=$(date +%s.%N)
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 $((WAIT * 10))); do running "$pid" || break; sleep 0.1; done
  if running "$pid"; then
    log "$name (pid $pid) still alive after ${WAIT}s: KILL"
    kill -KILL "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do running "$pid" || break; sleep 0.1; done
  fi
  log "stopped $name (pid $pid) in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s"
  rm -f "$PIDS/$name.pid"
}
node_slurmds=$(cd "$PIDS" && ls slurmd.*.pid 2>/dev/null | sed 's/\.pid$//' | tr '\n' ' ' || true)
for d in slurmd $node_slurmds slurmctld slurmdbd mariadbd munged; do stop_one "$d"; done

# 3. job steps left behind: slurmstepd processes started by this ROOT's slurmd (their
#    environment holds SLURM_CONF=ROOT/etc/slurm.conf), with all their descendants
steps=()
for p in /proc/[0-9]*; do
  [ "$(cat "$p/comm" 2>/dev/null || true)" = slurmstepd ] || continue
  envs=$(tr '\0' '\n' 2>/dev/null < "$p/environ" || true)
  if [[ $'\n'"$envs"$'\n' == *$'\n'"SLURM_CONF=$CONF"$'\n'* ]]; then steps+=("${p#/proc/}"); fi
done
if [ ${#steps[@]} -gt 0 ]; then
  # descendants, from the ppid field of /proc/PID/stat (the field after ") STATE")
  declare -A parent=()
  for s in /proc/[0-9]*/stat; do
    line=$(cat "$s" 2>/dev/null) || continue
    rest=${line##*) }
    read -r _state ppid _ <<< "$rest"
    parent[${line%% *}]=$ppid
  done
  all=("${steps[@]}")
  changed=1
  while [ "$changed" = 1 ]; do
    changed=0
    for pid in "${!parent[@]}"; do
      case " ${all[*]} " in *" $pid "*) continue ;; esac
      case " ${all[*]} " in *" ${parent[$pid]} "*) all+=("$pid"); changed=1 ;; esac
    done
  done
  log "killing leftover job steps and their processes: ${all[*]}"
  kill -KILL "${all[@]}" 2>/dev/null || true
  for _ in $(seq 1 50); do
    left=0
    for pid in "${all[@]}"; do running "$pid" && left=1; done
    [ "$left" = 0 ] && break
    sleep 0.1
  done
fi
# 4. the nodes' namespaces (anything still in them is killed), their veths and the bridge
if [ -f "$ROOT/netns" ]; then
  # shellcheck disable=SC1091
  . "$ROOT/netns"
  for ns in $(ip netns list 2>/dev/null | awk -v p="${NS_PREFIX}n" 'index($1, p) == 1 {print $1}'); do
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ' || true)
    if [ -n "${pids// /}" ]; then
      log "killing what still runs in $ns: $pids"
      # shellcheck disable=SC2086
      kill -KILL $pids 2>/dev/null || true
      for _ in $(seq 1 50); do
        left=0
        for pid in $pids; do running "$pid" && left=1; done
        [ "$left" = 0 ] && break
        sleep 0.1
      done
    fi
    ip netns del "$ns" && log "removed network namespace $ns"
  done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE" && log "removed bridge $BRIDGE"; fi
  rm -f "$ROOT/netns"
fi
rm -f "$ROOT/munge/munge.socket.2" "$ROOT/munge/munge.socket.2.lock" "$ROOT/mysql/mysqld.sock"
log "done"
