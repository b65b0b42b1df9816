#!/bin/bash
# Start a single-node Slurm (munged, MariaDB, slurmdbd, slurmctld, slurmd) on localhost,
# everything under ROOT: ROOT/etc (configs), ROOT/pids (one PID file per daemon started),
# ROOT/log, ROOT/state, ROOT/mysql, ROOT/munge. Writes ROOT/env.sh for the clients.
# No systemd needed. Stop with stop.sh ROOT.
#
# usage: start.sh ROOT
# env (all optional):
#   DPIPE_SLURM_CPUS         CPUs the node declares (default: 8, or nproc if more)
#   DPIPE_SLURM_MEM_MB       RealMemory of the node (default: 90% of MemTotal)
#   DPIPE_SLURM_DEF_MEM      DefMemPerCPU in MB (default: 256)
#   DPIPE_SLURM_PORT_BASE    slurmctld port; slurmd +1, slurmdbd +2, MariaDB +3 (default: the
#                            first of 6817, 6827, ..., 6907 whose four ports are all free)
#   DPIPE_SLURM_FIRST_JOB_ID first job id (default: time based, see below)
#   DPIPE_SLURM_TIMEOUT      seconds to wait for each daemon (default: 60)
#   DPIPE_SLURM_KEEP_ON_FAIL 1: leave the daemons running when the start fails (to debug)
#   DPIPE_SLURM_NETNS_NODES  N >= 1: N compute nodes node1..nodeN instead of one on localhost, each
#                            a network namespace of its own (own address, own hostname: a UTS
#                            namespace) with its own slurmd; see "Several nodes" below. Needs root
#                            and iproute2 (`ip`), util-linux (`unshare`, `nsenter`).
#   DPIPE_SLURM_SUBNET       with DPIPE_SLURM_NETNS_NODES: the first three octets of the private
#                            /24 for the nodes (default 10.213.B, B from the port block: 0..9)
#   DPIPE_SLURMD_TIMEOUT     SlurmdTimeout: seconds of silence before a node is DOWN (default:
#                            300, Slurm's; 10 with DPIPE_SLURM_NETNS_NODES)
#
# Several nodes (DPIPE_SLURM_NETNS_NODES=N): a bridge dpbr<port> in this (root) namespace holds
# the controller's address <subnet>.254; node K is the namespace dpipe<port>n<K> whose veth
# `dpnet0` has <subnet>.K, linked to the bridge. slurmctld, slurmdbd, MariaDB and munged stay
# here (munge's socket is a file: every namespace reaches it); each slurmd runs inside its node's
# namespace (`nsenter --net`, and `unshare --uts` so that its jobs see the node name as their
# hostname). The filesystem is shared, as a cluster's shared filesystem is. ROOT/netns lists the
# namespaces and links made; stop.sh removes them. node.sh ROOT NODE crash|start takes a node
# down as a crash does (link down, every process in it killed) and brings it back.
set -Eeuo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ $# -ne 1 ] || [ -z "$1" ]; then echo "usage: $0 ROOT" >&2; exit 2; fi
mkdir -p "$1"
ROOT=$(cd "$1" && pwd -P)

log() { echo "slurm start: $*"; }
case "$ROOT" in
  *[[:space:]@\|\\\"\'\$]*) echo "slurm start: ERROR: ROOT must not contain spaces or @|\\\"'\$: $ROOT" >&2; exit 2 ;;
esac
for b in munged mungekey mariadbd mariadb-install-db mariadb mariadb-admin slurmdbd slurmctld slurmd sinfo sacctmgr scontrol; do
  command -v "$b" >/dev/null || { echo "slurm start: ERROR: $b not found; run $HERE/install.sh first" >&2; exit 1; }
done
if [ "$(id -u)" != 0 ]; then
  log "WARNING: not root; slurmd needs root to launch jobs"
fi

now() { date +%s.%N; }
T0=$(now)
elapsed() { awk -v a="$T0" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }

PIDS=$ROOT/pids
CONF=$ROOT/etc/slurm.conf
DBDCONF=$ROOT/etc/slurmdbd.conf
TIMEOUT=${DPIPE_SLURM_TIMEOUT:-60}
for v in DPIPE_SLURM_CPUS DPIPE_SLURM_MEM_MB DPIPE_SLURM_DEF_MEM DPIPE_SLURM_PORT_BASE DPIPE_SLURM_FIRST_JOB_ID DPIPE_SLURM_TIMEOUT DPIPE_SLURM_NETNS_NODES DPIPE_SLURMD_TIMEOUT; do
  case "${!v:-1}" in ''|*[!0-9]*) echo "slurm start: ERROR: $v must be a positive integer, not '${!v}'" >&2; exit 2 ;; esac
done
HOST=$(hostname -s)
[ -n "$HOST" ] || { echo "slurm start: ERROR: empty hostname" >&2; exit 1; }
NODES=${DPIPE_SLURM_NETNS_NODES:-0}
if [ "$NODES" -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { echo "slurm start: ERROR: DPIPE_SLURM_NETNS_NODES needs root (network namespaces)" >&2; exit 1; }
  for b in ip unshare nsenter; do
    command -v "$b" >/dev/null || { echo "slurm start: ERROR: $b not found (DPIPE_SLURM_NETNS_NODES needs iproute2 and util-linux)" >&2; exit 1; }
  done
  NODE_NAMES=$(for k in $(seq 1 "$NODES"); do printf 'node%d ' "$k"; done)
  SLURMDS=$(for n in $NODE_NAMES; do printf 'slurmd.%s ' "$n"; done)
  SPOOL_SUFFIX=/%n  # one spool dir per slurmd: ROOT/state/d/<node>
  FILE_SUFFIX=.%n   # and its own log and pid file: ROOT/log/slurmd.<node>.log
  NODE_LEN=$(( ${#NODES} + 4 + ${#NODES} + 5 ))  # "/nodeK" + "nodeK" in the socket path
else
  NODE_NAMES=$HOST
  SLURMDS=slurmd
  SPOOL_SUFFIX=
  FILE_SUFFIX=
  NODE_LEN=${#HOST}
fi
# unix socket paths are limited to 107 bytes; the longest one under ROOT is a job step's
# socket ROOT/state/d[/<node>]/<node>_<jobid>.<stepid> (stepid of a batch step: 10 digits)
if [ $(( ${#ROOT} + NODE_LEN + 30 )) -gt 107 ]; then
  echo "slurm start: ERROR: ROOT is too long for unix socket paths (${#ROOT} chars, max $((77 - NODE_LEN)) with node names of ${NODE_LEN} chars): $ROOT" >&2
  exit 2
fi
USER_NAME=$(id -un)
CLUSTER=dpipe
PARTITION=debug
export SLURM_CONF=$CONF

# alive NAME: the PID recorded for NAME runs (not a zombie) and still is NAME (slurmd.node2: slurmd)
alive() {
  local pid st
  pid=$(tr -dc 0-9 2>/dev/null < "$PIDS/$1.pid") && [ -n "$pid" ] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "${1%%.*}" ] || return 1
  st=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
  st=${st##*) }
  [ "${st%% *}" != Z ]
}
DAEMONS="munged mariadbd slurmdbd slurmctld $SLURMDS"
N_DAEMONS=$(echo $DAEMONS | wc -w)

write_env() {
  cat > "$ROOT/env.sh" <<ENV
# source this: clients (sbatch, srun, squeue, sacct, submitit) find the local cluster
export SLURM_CONF=$CONF
export DPIPE_SLURM_ROOT=$ROOT
export DPIPE_SLURM_PARTITION=$PARTITION
ENV
  if [ "$NODES" -gt 0 ]; then
    cat >> "$ROOT/env.sh" <<ENV
# the nodes' network interface (each namespace's own), for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
export DPIPE_SLURM_IFNAME=dpnet0
export DPIPE_SLURM_NODES="${NODE_NAMES% }"
ENV
  fi
}

# ---- already running? ------------------------------------------------------------------
n_alive=0; n_files=0
for d in $DAEMONS; do
  [ -f "$PIDS/$d.pid" ] && n_files=$((n_files + 1))
  alive "$d" && n_alive=$((n_alive + 1))
done
if [ "$n_alive" = "$N_DAEMONS" ] && [[ "$(sinfo -h -N -o %t 2>/dev/null || true)" =~ (idle|mix|alloc) ]]; then
  write_env
  log "already running under $ROOT (pids in $PIDS); source $ROOT/env.sh"
  exit 0
fi
if [ "$n_files" -gt 0 ]; then
  log "found a partial or stale instance ($n_alive of $N_DAEMONS daemons alive): stopping it first"
  bash "$HERE/stop.sh" "$ROOT"
fi

# ---- ports ---------------------------------------------------------------------------------
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
ports_free() { local p; for p in "$1" $(($1 + 1)) $(($1 + 2)) $(($1 + 3)); do port_open "$p" && return 1; done; return 0; }
if [ -n "${DPIPE_SLURM_PORT_BASE:-}" ]; then
  PORT_BASE=$DPIPE_SLURM_PORT_BASE
  if ! ports_free "$PORT_BASE"; then
    echo "slurm start: ERROR: one of the ports $PORT_BASE..$((PORT_BASE + 3)) on 127.0.0.1 is in use" \
         "(DPIPE_SLURM_PORT_BASE=$PORT_BASE); another Slurm or MariaDB?" >&2
    exit 1
  fi
else
  PORT_BASE=
  for b in 6817 6827 6837 6847 6857 6867 6877 6887 6897 6907; do
    if ports_free "$b"; then PORT_BASE=$b; break; fi
  done
  [ -n "$PORT_BASE" ] || { echo "slurm start: ERROR: no free port block in 6817..6910 on 127.0.0.1; set DPIPE_SLURM_PORT_BASE" >&2; exit 1; }
fi
CTLD_PORT=$PORT_BASE; SLURMD_PORT=$((PORT_BASE + 1)); DBD_PORT=$((PORT_BASE + 2)); DB_PORT=$((PORT_BASE + 3))
if [ "$NODES" -gt 0 ]; then
  SUBNET=${DPIPE_SLURM_SUBNET:-10.213.$(( (PORT_BASE - 6817) / 10 % 256 ))}
  [[ "$SUBNET" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "slurm start: ERROR: DPIPE_SLURM_SUBNET must be three octets like 10.213.0, not '$SUBNET'" >&2; exit 2; }
  [ "$NODES" -le 250 ] || { echo "slurm start: ERROR: DPIPE_SLURM_NETNS_NODES must be at most 250" >&2; exit 2; }
  if ip -4 addr show | grep -q "inet $SUBNET\."; then
    echo "slurm start: ERROR: the subnet $SUBNET.0/24 is in use here (ip addr); set DPIPE_SLURM_SUBNET" >&2; exit 1
  fi
  CTLD_ADDR=$SUBNET.254
  NODE_ADDRS=$(for k in $(seq 1 "$NODES"); do printf '%s.%d,' "$SUBNET" "$k"; done)
  NODE_ADDRS=${NODE_ADDRS%,}
  SLURMD_TIMEOUT=${DPIPE_SLURMD_TIMEOUT:-10}
else
  CTLD_ADDR=127.0.0.1
  NODE_ADDRS=127.0.0.1
  SLURMD_TIMEOUT=${DPIPE_SLURMD_TIMEOUT:-300}
fi
NODE_LIST=$(echo $NODE_NAMES | tr ' ' ,)

# ---- failure handling: show the logs, stop what was started --------------------------------
show_logs() {
  for f in "$ROOT"/log/*; do
    [ -s "$f" ] || continue
    echo "----- tail of $f -----" >&2
    tail -n 25 "$f" >&2
  done
}
fail() {
  trap - ERR INT TERM HUP
  echo "slurm start: ERROR: $*" >&2
  show_logs
  if [ "${DPIPE_SLURM_KEEP_ON_FAIL:-0}" = 1 ]; then
    echo "slurm start: leaving daemons running (DPIPE_SLURM_KEEP_ON_FAIL=1); stop with $HERE/stop.sh $ROOT" >&2
  else
    echo "slurm start: stopping the daemons started so far" >&2
    bash "$HERE/stop.sh" "$ROOT" >&2 || true
  fi
  exit 1
}
trap 'fail "command failed (line $LINENO): $BASH_COMMAND"' ERR
trap 'fail "interrupted"' INT TERM HUP

# wait_for NAME DESCRIPTION COMMAND...: poll until COMMAND succeeds; fail if the daemon died
wait_for() {
  local name=$1 what=$2; shift 2
  local deadline
  deadline=$(awk -v t="$(now)" -v d="$TIMEOUT" 'BEGIN{printf "%d", t+d}')
  until "$@" >/dev/null 2>&1; do
    alive "$name" || fail "$name (pid $(cat "$PIDS/$name.pid" 2>/dev/null)) died while waiting for: $what"
    [ "$(date +%s)" -lt "$deadline" ] || fail "timed out after ${TIMEOUT}s waiting for: $what"
    sleep 0.1
  done
}
# spawn NAME COMMAND...: run a foreground daemon in its own session, record its PID
spawn() {
  local name=$1; shift
  setsid "$@" < /dev/null > "$ROOT/log/$name.out" 2>&1 &
  echo $! > "$PIDS/$name.pid"
}

# ---- layout and configs ---------------------------------------------------------------------
mkdir -p "$ROOT/etc" "$PIDS" "$ROOT/run" "$ROOT/log" "$ROOT/munge" "$ROOT/state" "$ROOT/mysql"
chmod 755 "$ROOT/munge"
# fresh slurmctld/slurmd state: no jobs of an earlier run come back (they would be requeued)
rm -rf "$ROOT/state/ctld" "$ROOT/state/d"
mkdir -p "$ROOT/state/ctld" "$ROOT/state/d"
rm -f "$ROOT"/log/*.log "$ROOT"/log/*.out "$ROOT"/log/*.err "$ROOT"/run/*.pid

NPROC=$(nproc)
CPUS=${DPIPE_SLURM_CPUS:-$(( NPROC > 8 ? NPROC : 8 ))}
MEM_MB=${DPIPE_SLURM_MEM_MB:-$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)}
DEF_MEM=${DPIPE_SLURM_DEF_MEM:-256}
# job ids: a wiped state dir restarts at FirstJobId. Make it time based (100 ids per second,
# wraps after ~7 days, stays below MaxJobId=67043328) and above the last id this ROOT used,
# so that a reused submitit folder (%j) or the accounting DB never sees an id twice.
if [ -n "${DPIPE_SLURM_FIRST_JOB_ID:-}" ]; then
  FIRST_JOB_ID=$DPIPE_SLURM_FIRST_JOB_ID
else
  FIRST_JOB_ID=$(( ($(date +%s) % 600000) * 100 + 1 ))
  if [ -f "$ROOT/state/next_job_id" ]; then
    prev=$(tr -dc 0-9 < "$ROOT/state/next_job_id")
    if [ -n "$prev" ] && [ "$prev" -gt "$FIRST_JOB_ID" ] && [ "$prev" -lt 66000000 ]; then FIRST_JOB_ID=$prev; fi
  fi
fi
DB_PASS=slurmpw

render() {
  sed -e "s|@ROOT@|$ROOT|g" -e "s|@HOST@|$HOST|g" -e "s|@USER@|$USER_NAME|g" \
      -e "s|@CLUSTER@|$CLUSTER|g" -e "s|@PARTITION@|$PARTITION|g" \
      -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@SLURMD_PORT@|$SLURMD_PORT|g" \
      -e "s|@DBD_PORT@|$DBD_PORT|g" -e "s|@DB_PORT@|$DB_PORT|g" -e "s|@DB_PASS@|$DB_PASS|g" \
      -e "s|@CPUS@|$CPUS|g" -e "s|@MEM_MB@|$MEM_MB|g" -e "s|@DEF_MEM_PER_CPU@|$DEF_MEM|g" \
      -e "s|@FIRST_JOB_ID@|$FIRST_JOB_ID|g" -e "s|@CTLD_ADDR@|$CTLD_ADDR|g" \
      -e "s|@NODE_NAMES@|$NODE_LIST|g" -e "s|@NODE_ADDRS@|$NODE_ADDRS|g" \
      -e "s|@SPOOL_SUFFIX@|$SPOOL_SUFFIX|g" -e "s|@FILE_SUFFIX@|$FILE_SUFFIX|g" -e "s|@SLURMD_TIMEOUT@|$SLURMD_TIMEOUT|g" "$1" > "$2"
  if grep -q '@[A-Z_]*@' "$2"; then fail "unfilled placeholder in $2: $(grep -o '@[A-Z_]*@' "$2" | head -1)"; fi
}
render "$HERE/slurm.conf.in" "$CONF"
render "$HERE/slurmdbd.conf.in" "$DBDCONF"
chmod 644 "$CONF"
chmod 600 "$DBDCONF"   # slurmdbd refuses a slurmdbd.conf that others can read
log "configs in $ROOT/etc (nodes $NODE_LIST at $NODE_ADDRS: CPUs=$CPUS RealMemory=${MEM_MB}M DefMemPerCPU=${DEF_MEM}M, FirstJobId=$FIRST_JOB_ID)"

# ---- 0. the nodes' network: a bridge here, a namespace + veth per node ------------------------
if [ "$NODES" -gt 0 ]; then
  BRIDGE=dpbr$CTLD_PORT
  {
    echo "SUBNET=$SUBNET"
    echo "BRIDGE=$BRIDGE"
    echo "NODES=\"${NODE_NAMES% }\""
    echo "NS_PREFIX=dpipe${CTLD_PORT}"
    echo "VETH_PREFIX=dpv${CTLD_PORT}"
  } > "$ROOT/netns"  # read by node.sh and stop.sh (which removes all of it), written first
  ip link add "$BRIDGE" type bridge || fail "could not create the bridge $BRIDGE (ip link add)"
  ip addr add "$CTLD_ADDR/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  k=0
  for n in $NODE_NAMES; do
    k=$((k + 1))
    ns=dpipe${CTLD_PORT}n$k; veth=dpv${CTLD_PORT}n$k
    ip netns add "$ns" || fail "could not create the network namespace $ns (ip netns add)"
    ip link add "$veth" type veth peer name dpnet0 netns "$ns"
    ip link set "$veth" master "$BRIDGE"
    ip link set "$veth" up
    ip -n "$ns" addr add "$SUBNET.$k/24" dev dpnet0
    ip -n "$ns" link set dpnet0 up
    ip -n "$ns" link set lo up
  done
  log "network: bridge $BRIDGE $CTLD_ADDR/24; nodes $NODE_LIST at $NODE_ADDRS in namespaces dpipe${CTLD_PORT}n1..$NODES ($(elapsed) s)"
fi

# ---- 1. munged: own key, own socket ----------------------------------------------------------
MSOCK=$ROOT/munge/munge.socket.2
[ -s "$ROOT/munge/munge.key" ] || mungekey --create --keyfile="$ROOT/munge/munge.key"
chmod 400 "$ROOT/munge/munge.key"
rm -f "$MSOCK" "$MSOCK.lock"
munged --key-file="$ROOT/munge/munge.key" --socket="$MSOCK" --pid-file="$PIDS/munged.pid" \
  --log-file="$ROOT/log/munged.log" --seed-file="$ROOT/munge/munged.seed" < /dev/null > "$ROOT/log/munged.out" 2>&1 \
  || fail "munged did not start"
munge_ok() { munge -n -S "$MSOCK" | unmunge -S "$MSOCK"; }
wait_for munged "munge credential round trip on $MSOCK" munge_ok
log "munged up ($(elapsed) s)"

# ---- 2. MariaDB on 127.0.0.1:$DB_PORT, datadir under ROOT --------------------------------------
M=$ROOT/mysql
if [ ! -d "$M/data/mysql" ]; then
  rm -rf "$M/data"
  log "initialising MariaDB datadir $M/data"
  mariadb-install-db --no-defaults --datadir="$M/data" --user="$USER_NAME" \
    --auth-root-authentication-method=normal --skip-test-db > "$ROOT/log/mariadb-install.log" 2>&1 \
    || fail "mariadb-install-db failed"
fi
rm -f "$M/mysqld.sock" "$M/mysqld.sock.lock"
spawn mariadbd mariadbd --no-defaults --user="$USER_NAME" --datadir="$M/data" --socket="$M/mysqld.sock" \
  --pid-file="$ROOT/run/mariadbd.pid" --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
  --log-error="$ROOT/log/mariadb.err" --innodb-buffer-pool-size=64M --innodb-lock-wait-timeout=900 \
  --innodb-flush-log-at-trx-commit=2 --innodb-use-native-aio=0 --max-connections=50
wait_for mariadbd "MariaDB answering on $M/mysqld.sock" mariadb-admin --no-defaults -S "$M/mysqld.sock" -uroot ping
mariadb --no-defaults -S "$M/mysqld.sock" -uroot -e "
  CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
  CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
  GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" || fail "could not create the MariaDB user slurm"
log "mariadbd up on 127.0.0.1:$DB_PORT ($(elapsed) s)"

# ---- 3. slurmdbd (reads slurmdbd.conf next to \$SLURM_CONF) -----------------------------------
spawn slurmdbd slurmdbd -D
wait_for slurmdbd "slurmdbd listening on 127.0.0.1:$DBD_PORT" port_open "$DBD_PORT"
log "slurmdbd up on 127.0.0.1:$DBD_PORT ($(elapsed) s)"

# ---- 4. slurmctld, slurmd ------------------------------------------------------------------------
spawn slurmctld slurmctld -D -f "$CONF"
wait_for slurmctld "slurmctld answering (scontrol ping)" scontrol ping
log "slurmctld up on $CTLD_ADDR:$CTLD_PORT ($(elapsed) s)"
if [ "$NODES" -gt 0 ]; then
  for n in $NODE_NAMES; do bash "$HERE/node.sh" "$ROOT" "$n" start; done
  first=slurmd.node1
else
  spawn slurmd slurmd -D -f "$CONF" -N "$HOST"
  first=slurmd
fi
node_idle() { [ "$(sinfo -h -N -p "$PARTITION" -o %t | sort | uniq -c | awk '{print $1, $2}')" = "$(echo $NODE_NAMES | wc -w) idle" ]; }
wait_for "$first" "nodes $NODE_LIST idle in sinfo" node_idle
log "slurmd up, nodes $NODE_LIST idle ($(elapsed) s)"

# ---- 5. accounting: the cluster must be known to slurmdbd for sacct ---------------------------------
cluster_known() { local c; c=$(sacctmgr -n -P list cluster format=cluster) && [[ $'\n'"$c"$'\n' == *$'\n'"$CLUSTER"$'\n'* ]]; }
if ! cluster_known; then
  log "registering cluster $CLUSTER in accounting"
  sacctmgr -i add cluster "$CLUSTER" > /dev/null || fail "sacctmgr add cluster failed"
  scontrol reconfigure
  wait_for slurmctld "cluster $CLUSTER registered in slurmdbd" cluster_known
fi
sacct -n -X -S now-1minutes > /dev/null || fail "sacct does not work"

write_env
trap - ERR INT TERM HUP
log "ready in $(elapsed) s: partition $PARTITION, $CPUS CPUs; clients: source $ROOT/env.sh"
sinfo
