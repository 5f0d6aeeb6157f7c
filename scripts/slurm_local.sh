#!/usr/bin/env bash
# A real, tiny SLURM cluster on this one machine, for trying the launcher and for tests/slurm.
#
#   scripts/slurm_local.sh install   # apt packages (skipped when already present)
#   scripts/slurm_local.sh start     # munge + MariaDB + slurmdbd + slurmctld + 2 fake nodes
#   scripts/slurm_local.sh status    # daemons, sinfo, accounting; exit 0 only when healthy
#   scripts/slurm_local.sh env       # prints `export SLURM_CONF=...` (eval it if needed)
#   scripts/slurm_local.sh stop      # stops only the daemons `start` started (pid files)
#   scripts/slurm_local.sh purge     # stop, then delete the state dir (job ids restart at 1)
#
# install (when packages are missing), start, stop and purge need root; another user's call
# runs itself again through sudo.
# Layout: nodes n1, n2 (2 CPUs each, 127.0.0.1 ports 17001/17002), partitions `debug`
# (default, no time limit) and `short` (MaxTime 5 min, limits enforced at submission).
# Everything (configs, munge socket and key, MariaDB datadir, spool, logs, pid files) lives in
# the state dir: $MXFP8EP_SLURM_STATE, default /tmp/mxfp8ep-slurm. Private ports and sockets,
# so a system munge/MariaDB/SLURM on the default ones is left alone:
#   slurmctld 17017, slurmdbd 17019, MariaDB 127.0.0.1:17306, munge $STATE/munge/munge.socket.
# /etc/slurm/slurm.conf is made a symlink to $STATE/etc/slurm.conf when absent, so plain
# `sinfo`/`sbatch` (and submitit) find the cluster; if another slurm.conf is there, export
# SLURM_CONF (see `env`). Accounting (slurmdbd) is required: submitit polls `sacct`, and without
# it a crashed or cancelled job is never reported.
set -euo pipefail

STATE=${MXFP8EP_SLURM_STATE:-/tmp/mxfp8ep-slurm}
CLUSTER=mxfp8ep
CTLD_PORT=17017
DBD_PORT=17019
DB_PORT=17306
NODES=(n1 n2)
NODE_PORTS=(17001 17002)
DB_PASS=mxfp8ep-slurm
START_TIMEOUT=${MXFP8EP_SLURM_START_TIMEOUT:-60}
APT_PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server)
REQUIRED_CMDS=(slurmctld slurmd slurmdbd sinfo sbatch sacct sacctmgr scontrol munged mungekey
               mariadbd mariadb-install-db mariadb)

CONF=$STATE/etc/slurm.conf
DBD_CONF=$STATE/etc/slurmdbd.conf
RUN=$STATE/run
LOG=$STATE/log
MUNGE_DIR=$STATE/munge
MUNGE_SOCK=$MUNGE_DIR/munge.socket
DB_DIR=$STATE/mysql
DB_SOCK_DIR=$STATE/mysql-run
DB_SOCK=$DB_SOCK_DIR/mysqld.sock
DB_PID=$DB_SOCK_DIR/mariadbd.pid  # mariadbd runs as mysql: its pid/log files live in its dir
DB_LOG=$DB_SOCK_DIR/mariadbd.log
export SLURM_CONF=$CONF

log() { echo "[slurm_local] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Packages and daemons (run as root/munge/mysql) need root: another user re-runs the command
# through sudo, keeping the state dir and timeout; without sudo that user is told to be root.
ARGS=("$@")
need_root() {
  [[ $(id -u) == 0 ]] && return 0
  command -v sudo >/dev/null 2>&1 ||
    die "must run as root (daemons run as root/munge/mysql), and there is no sudo here: run it as root"
  log "not root: running '$0 ${ARGS[*]}' through sudo"
  exec sudo MXFP8EP_SLURM_STATE="$STATE" MXFP8EP_SLURM_START_TIMEOUT="$START_TIMEOUT" \
    bash "$0" "${ARGS[@]}"
}

# ---------------------------------------------------------------------------------- install
cmd_install() {
  local missing=() c
  for c in "${REQUIRED_CMDS[@]}"; do command -v "$c" >/dev/null 2>&1 || missing+=("$c"); done
  if ((${#missing[@]} == 0)); then log "packages present, nothing to install"; return 0; fi
  need_root
  command -v apt-get >/dev/null 2>&1 || die "apt-get not found (missing: ${missing[*]})"
  log "installing ${APT_PACKAGES[*]} (missing: ${missing[*]})"
  # Keep package scripts from starting system services (no systemd here; ours are private).
  local policy=/usr/sbin/policy-rc.d made_policy=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"; chmod 755 "$policy"; made_policy=1
  fi
  local rc=0
  {
    DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${APT_PACKAGES[@]}"
  } >"${TMPDIR:-/tmp}/slurm_local_apt.log" 2>&1 || rc=$?
  ((made_policy)) && rm -f "$policy"
  if ((rc != 0)); then
    tail -30 "${TMPDIR:-/tmp}/slurm_local_apt.log" >&2
    die "apt-get failed (rc=$rc), full log: ${TMPDIR:-/tmp}/slurm_local_apt.log"
  fi
  for c in "${REQUIRED_CMDS[@]}"; do command -v "$c" >/dev/null 2>&1 || die "still missing: $c"; done
  log "installed: $(slurmctld -V)"
}

# ---------------------------------------------------------------------- process bookkeeping
# A pid file is "ours and alive" when the process exists, is not a zombie (killed daemons
# linger as zombies here: PID 1 does not reap them, so `kill -0` lies) and has the right name.
pid_alive() { # pidfile comm
  local pidfile=$1 comm=$2 pid st
  [[ -s $pidfile ]] || return 1
  pid=$(cat "$pidfile" 2>/dev/null | tr -dc 0-9); [[ -n $pid ]] || return 1
  [[ -r /proc/$pid/status ]] || return 1
  st=$(awk '/^State:/{print $2}' "/proc/$pid/status" 2>/dev/null) || return 1
  [[ $st != Z && $st != X ]] || return 1
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$comm"* ]] || return 1
  echo "$pid"
}

stop_pidfile() { # pidfile comm label
  local pidfile=$1 comm=$2 label=$3 pid i
  if ! pid=$(pid_alive "$pidfile" "$comm"); then rm -f "$pidfile"; return 0; fi
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do  # up to 10 s, then SIGKILL
    pid_alive "$pidfile" "$comm" >/dev/null || { rm -f "$pidfile"; log "stopped $label ($pid)"; return 0; }
    sleep 0.1
  done
  kill -KILL "$pid" 2>/dev/null || true
  for ((i = 0; i < 30; i++)); do
    pid_alive "$pidfile" "$comm" >/dev/null || break
    sleep 0.1
  done
  rm -f "$pidfile"
  log "killed $label ($pid)"
}

wait_for() { # seconds description command...
  local secs=$1 what=$2; shift 2
  local deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || return 1
    sleep 0.2
  done
}

# Daemons must not hold the caller's stdout/stderr (pytest's subprocess pipes would never
# close) nor the lock (fd 9): all of them get /dev/null in, a log file out, fd 9 closed.
spawn() { # logfile command...  (background, own session; pid in $SPAWNED)
  local logfile=$1; shift
  setsid "$@" </dev/null >>"$logfile" 2>&1 9>&- &
  SPAWNED=$!
}
spawned_alive() { [[ -r /proc/$SPAWNED/status ]] && ! grep -Eq '^State:\s+[ZX]' "/proc/$SPAWNED/status"; }

port_busy() { # port -> 0 if something listens on 127.0.0.1/any:port
  local hex; hex=$(printf ':%04X ' "$1")
  grep -q " 0A " <(awk -v p="$hex" 'NR>1 && index($2 " ", p) {print " " $4 " "}' /proc/net/tcp /proc/net/tcp6 2>/dev/null)
}

# -------------------------------------------------------------------------------- configs
write_configs() {
  mkdir -p "$STATE"/{etc,run,log,ctld} "$STATE"/spool
  chmod 755 "$STATE"
  local i nodes_csv
  nodes_csv=$(IFS=,; echo "${NODES[*]}")
  {
    cat <<EOF
# Generated by scripts/slurm_local.sh -- local test cluster, rewritten on every start.
ClusterName=$CLUSTER
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCK
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No systemd/cgroups here: plain process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Trust the node lines below even where the host has fewer cores/memory (CI runners).
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_min_interval=0
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
# The munge socket for talking to slurmdbd (AuthInfo alone does not cover that link).
AccountingStoragePass=$MUNGE_SOCK
# Reject requests a partition cannot satisfy at submission instead of pending forever.
EnforcePartLimits=ALL
JobRequeue=1
# Short grace periods: tests cancel/requeue jobs and should not wait the 30 s defaults.
KillWait=5
MinJobAge=60
MessageTimeout=10
SlurmdTimeout=60
InactiveLimit=0
Waittime=0
MailProg=/bin/true
EOF
    for i in "${!NODES[@]}"; do
      echo "NodeName=${NODES[$i]} NodeHostname=localhost NodeAddr=127.0.0.1 Port=${NODE_PORTS[$i]} CPUs=2 RealMemory=8000 State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=$nodes_csv Default=YES MaxTime=INFINITE State=UP"
    echo "PartitionName=short Nodes=$nodes_csv MaxTime=5 State=UP"
  } >"$CONF.tmp"
  mv -f "$CONF.tmp" "$CONF"
  chmod 644 "$CONF"

  umask_old=$(umask); umask 077
  cat >"$DBD_CONF.tmp" <<EOF
# Generated by scripts/slurm_local.sh
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
  umask "$umask_old"
  mv -f "$DBD_CONF.tmp" "$DBD_CONF"
  chmod 600 "$DBD_CONF"

  # Plain `sinfo`/`sbatch` (and submitit) read /etc/slurm/slurm.conf unless SLURM_CONF is set.
  mkdir -p /etc/slurm
  if [[ ! -e /etc/slurm/slurm.conf && ! -L /etc/slurm/slurm.conf ]] ||
     [[ -L /etc/slurm/slurm.conf && $(readlink /etc/slurm/slurm.conf) == "$CONF" ]]; then
    ln -sfn "$CONF" /etc/slurm/slurm.conf
  elif [[ -L /etc/slurm/slurm.conf && $(readlink /etc/slurm/slurm.conf) == */mxfp8ep*/etc/slurm.conf ]]; then
    ln -sfn "$CONF" /etc/slurm/slurm.conf  # an older state dir of ours
  else
    log "NOTE: /etc/slurm/slurm.conf belongs to something else; use: export SLURM_CONF=$CONF"
  fi
}

ensure_hosts() {
  local n missing=()
  for n in "${NODES[@]}"; do
    grep -Eq "^[[:space:]]*127\.0\.0\.1([[:space:]].*)?[[:space:]]$n([[:space:]]|$)" /etc/hosts || missing+=("$n")
  done
  if ((${#missing[@]})); then
    # /etc/hosts may be a bind mount (containers): append in place, never replace the file.
    echo "127.0.0.1 ${missing[*]}  # mxfp8ep local slurm" >>/etc/hosts
    log "added ${missing[*]} to /etc/hosts"
  fi
}

# -------------------------------------------------------------------------------- daemons
start_munge() {
  if pid_alive "$RUN/munged.pid" munged >/dev/null; then return 0; fi
  mkdir -p "$MUNGE_DIR"
  chown munge:munge "$MUNGE_DIR"; chmod 700 "$MUNGE_DIR"
  if [[ ! -s $MUNGE_DIR/munge.key ]]; then
    if [[ -s /etc/munge/munge.key ]]; then cp /etc/munge/munge.key "$MUNGE_DIR/munge.key"
    else mungekey -c -k "$MUNGE_DIR/munge.key" >/dev/null 2>&1 || dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=128 count=1 2>/dev/null
    fi
  fi
  chown munge:munge "$MUNGE_DIR/munge.key"; chmod 400 "$MUNGE_DIR/munge.key"
  rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
  touch "$RUN/munged.pid" && chown munge:munge "$RUN/munged.pid"
  # munged forks itself; it writes its pid file as user munge.
  runuser -u munge -- /usr/sbin/munged --socket="$MUNGE_SOCK" --key-file="$MUNGE_DIR/munge.key" \
    --pid-file="$RUN/munged.pid" --log-file="$MUNGE_DIR/munged.log" \
    --seed-file="$MUNGE_DIR/munged.seed" --num-threads=8 --force </dev/null >>"$LOG/munged.out" 2>&1 9>&- ||
    { cat "$MUNGE_DIR/munged.log" "$LOG/munged.out" >&2 2>/dev/null; die "munged failed to start"; }
  wait_for 10 munge bash -c "munge -n -S '$MUNGE_SOCK' | unmunge -S '$MUNGE_SOCK'" ||
    { tail -20 "$MUNGE_DIR/munged.log" >&2; die "munge does not answer on $MUNGE_SOCK"; }
  log "munged up"
}

db() { mariadb --no-defaults --protocol=socket --socket="$DB_SOCK" -u root "$@"; }
db_up_or_dead() { db -e "SELECT 1" || ! spawned_alive; }

start_mariadb() {
  if ! pid_alive "$DB_PID" mariadbd >/dev/null; then
    port_busy "$DB_PORT" && die "port $DB_PORT busy (not our MariaDB?)"
    mkdir -p "$DB_SOCK_DIR"
    chown mysql:mysql "$DB_SOCK_DIR"  # root-owned socket dir: mariadbd fails silently
    if [[ ! -d $DB_DIR/mysql ]]; then
      rm -rf "$DB_DIR"; mkdir -p "$DB_DIR"; chown mysql:mysql "$DB_DIR"
      log "initialising MariaDB datadir"
      mariadb-install-db --no-defaults --user=mysql --datadir="$DB_DIR" --skip-test-db \
        --auth-root-authentication-method=socket >"$LOG/mariadb-install.log" 2>&1 ||
        { tail -30 "$LOG/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
    fi
    rm -f "$DB_SOCK" "$DB_PID"
    spawn "$LOG/mariadbd.out" /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$DB_DIR" \
      --socket="$DB_SOCK" --port="$DB_PORT" --bind-address=127.0.0.1 --pid-file="$DB_PID" \
      --log-error="$DB_LOG" --skip-log-bin --innodb-buffer-pool-size=64M \
      --innodb-log-file-size=16M --innodb-lock-wait-timeout=900 --max-connections=50 \
      --skip-name-resolve
    wait_for 30 mariadb db_up_or_dead; db -e "SELECT 1" >/dev/null 2>&1 ||
      { tail -30 "$DB_LOG" >&2; die "MariaDB did not come up"; }
    log "mariadbd up"
  fi
  db <<EOF || die "could not create the slurm DB user"
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
FLUSH PRIVILEGES;
EOF
}

sacctmgr_ok() { timeout 10 sacctmgr -n -P show cluster format=cluster; }

start_slurmdbd() {
  if ! pid_alive "$RUN/slurmdbd.pid" slurmdbd >/dev/null; then
    port_busy "$DBD_PORT" && die "port $DBD_PORT busy (not our slurmdbd?)"
    # slurmdbd finds slurmdbd.conf next to $SLURM_CONF; it daemonizes and writes PidFile.
    slurmdbd </dev/null >>"$LOG/slurmdbd.out" 2>&1 9>&- ||
      { tail -20 "$LOG/slurmdbd.log" >&2; die "slurmdbd failed to start"; }
    wait_for 30 slurmdbd sacctmgr_ok ||
      { tail -20 "$LOG/slurmdbd.log" >&2; die "slurmdbd does not answer"; }
    log "slurmdbd up"
  fi
  if ! sacctmgr_ok | grep -x "$CLUSTER" >/dev/null; then  # all of it read: no broken pipe under pipefail
    timeout 20 sacctmgr -i add cluster "$CLUSTER" >/dev/null || die "sacctmgr add cluster failed"
    log "registered cluster $CLUSTER in accounting"
  fi
}

start_slurmctld() {
  if ! pid_alive "$RUN/slurmctld.pid" slurmctld >/dev/null; then
    port_busy "$CTLD_PORT" && die "port $CTLD_PORT busy (not our slurmctld?)"
    slurmctld -f "$CONF" </dev/null >>"$LOG/slurmctld.out" 2>&1 9>&- ||
      { tail -20 "$LOG/slurmctld.log" >&2; die "slurmctld failed to start"; }
    wait_for 20 slurmctld bash -c "timeout 5 scontrol ping | grep -q UP" ||
      { tail -20 "$LOG/slurmctld.log" >&2; die "slurmctld does not answer"; }
    log "slurmctld up"
  fi
}

start_slurmd() {
  local i n
  for i in "${!NODES[@]}"; do
    n=${NODES[$i]}
    pid_alive "$RUN/slurmd-$n.pid" slurmd >/dev/null && continue
    port_busy "${NODE_PORTS[$i]}" && die "port ${NODE_PORTS[$i]} busy (not our slurmd $n?)"
    mkdir -p "$STATE/spool/$n"
    slurmd -f "$CONF" -N "$n" </dev/null >>"$LOG/slurmd-$n.out" 2>&1 9>&- ||
      { tail -20 "$LOG/slurmd-$n.log" >&2; die "slurmd $n failed to start"; }
    log "slurmd $n started"
  done
}

# ---------------------------------------------------------------------------------- health
daemons_alive() {
  local n
  pid_alive "$RUN/munged.pid" munged >/dev/null &&
    pid_alive "$DB_PID" mariadbd >/dev/null &&
    pid_alive "$RUN/slurmdbd.pid" slurmdbd >/dev/null &&
    pid_alive "$RUN/slurmctld.pid" slurmctld >/dev/null || return 1
  for n in "${NODES[@]}"; do pid_alive "$RUN/slurmd-$n.pid" slurmd >/dev/null || return 1; done
}

# Every node up (idle, or busy with jobs) and not down/drained/unknown.
nodes_ready() {
  local out n st
  out=$(timeout 5 sinfo -h -N -p debug -o '%N %t' 2>/dev/null) || return 1
  for n in "${NODES[@]}"; do
    st=$(awk -v n="$n" '$1 == n {print $2}' <<<"$out")
    [[ $st =~ ^(idle|mix|mixed|alloc|allocated|comp|completing)$ ]] || return 1
  done
}

sacct_ok() { timeout 10 sacct -n -X -S now-1minutes -o JobID >/dev/null 2>&1; }

healthy() { [[ -f $CONF ]] && daemons_alive && nodes_ready && sacct_ok; }

# ---------------------------------------------------------------------------------- commands
cmd_start() {
  need_root
  local c
  for c in "${REQUIRED_CMDS[@]}"; do
    command -v "$c" >/dev/null 2>&1 || die "$c not found: run '$0 install' first"
  done
  if healthy; then log "already running and healthy (state: $STATE)"; return 0; fi
  local t0=$SECONDS
  write_configs
  ensure_hosts
  start_munge
  start_mariadb
  start_slurmdbd
  start_slurmctld
  start_slurmd
  # slurmd registration -> nodes idle (ReturnToService=2 clears a previous DOWN state).
  if ! wait_for "$START_TIMEOUT" nodes nodes_ready; then
    timeout 5 sinfo -N >&2 || true
    local n; for n in "${NODES[@]}"; do tail -5 "$LOG/slurmd-$n.log" >&2 2>/dev/null || true; done
    die "nodes did not become idle within ${START_TIMEOUT}s (logs: $LOG)"
  fi
  wait_for 30 sacct sacct_ok || die "sacct does not answer (logs: $LOG/slurmdbd.log)"
  log "cluster $CLUSTER up in $((SECONDS - t0))s (state: $STATE)"
  timeout 5 sinfo >&2 || true
}

cmd_stop() {
  [[ -d $STATE ]] || { log "no state dir $STATE, nothing to stop"; return 0; }
  local n
  # Cancel leftover jobs first so their job steps do not outlive the daemons.
  if pid_alive "$RUN/slurmctld.pid" slurmctld >/dev/null; then
    if [[ -n $(timeout 5 squeue -h -o %i 2>/dev/null) ]]; then
      timeout 5 scancel --full -u root 2>/dev/null || true
      wait_for 10 "jobs gone" bash -c '[[ -z $(timeout 5 squeue -h -o %i 2>/dev/null) ]]' || true
    fi
  fi
  for ((i = ${#NODES[@]} - 1; i >= 0; i--)); do
    n=${NODES[$i]}; stop_pidfile "$RUN/slurmd-$n.pid" slurmd "slurmd $n"
  done
  stop_pidfile "$RUN/slurmctld.pid" slurmctld slurmctld
  stop_pidfile "$RUN/slurmdbd.pid" slurmdbd slurmdbd
  stop_pidfile "$DB_PID" mariadbd mariadbd
  stop_pidfile "$RUN/munged.pid" munged munged
  log "stopped (state kept in $STATE)"
}

cmd_purge() {
  cmd_stop
  case $STATE in /|/tmp|/root|/home|"") die "refusing to delete $STATE";; esac
  rm -rf "$STATE"
  if [[ -L /etc/slurm/slurm.conf && $(readlink /etc/slurm/slurm.conf) == "$CONF" ]]; then
    rm -f /etc/slurm/slurm.conf
  fi
  log "purged $STATE"
}

cmd_status() {
  local n ok=0
  echo "state dir: $STATE"
  echo "SLURM_CONF=$CONF"
  local entries=("munged|$RUN/munged.pid|munged" "mariadbd|$DB_PID|mariadbd"
                 "slurmdbd|$RUN/slurmdbd.pid|slurmdbd" "slurmctld|$RUN/slurmctld.pid|slurmctld")
  for n in "${NODES[@]}"; do entries+=("slurmd $n|$RUN/slurmd-$n.pid|slurmd"); done
  local e label pidf comm pid
  for e in "${entries[@]}"; do
    IFS='|' read -r label pidf comm <<<"$e"
    if pid=$(pid_alive "$pidf" "$comm"); then echo "  $label: running (pid $pid)"
    else echo "  $label: not running"; ok=1; fi
  done
  if ((ok == 0)); then
    timeout 5 sinfo || ok=1
    nodes_ready || { echo "nodes not ready"; ok=1; }
    if sacct_ok; then echo "accounting: ok"; else echo "accounting: NOT answering"; ok=1; fi
  fi
  ((ok == 0)) && echo "healthy" || echo "not healthy"
  return $ok
}

# One start/stop/purge at a time (several test sessions or users may share the cluster).
locked() {
  exec 9>"${STATE%/}.lock"
  flock -w 300 9 || die "another slurm_local.sh holds ${STATE%/}.lock"
  "$@"
}

case ${1:-} in
  install) cmd_install ;;
  start|stop|purge) need_root; locked "cmd_$1" ;;  # root before the lock: sudo would hold it
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
