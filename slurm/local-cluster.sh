#!/usr/bin/env bash
# A real Slurm cluster of K virtual nodes on this one host, for ftkit's tests and demo.
#
#   slurm/local-cluster.sh up [K]    install slurm-wlm + munge if needed, start munged (unless one
#                                    works), slurmctld and one slurmd per node n1..nK; wait until
#                                    all nodes are idle. K: argument, else $FTKIT_SLURM_NODES, else 5.
#                                    Already up with K nodes: restart any dead slurmd, resume down
#                                    nodes, check, return 0. Up with another K: restart with K.
#   slurm/local-cluster.sh down      cancel the jobs, stop the daemons this script started (by their
#                                    pid files; munged only if it started it), restore /etc/slurm.
#   slurm/local-cluster.sh status    print the nodes; exit 0 when the controller answers and every
#                                    node is usable, 2 when some node is not, 1 when not up.
#
# Every node has NodeAddr=127.0.0.1, the host's name and its own slurmd port; each slurmd is
# started as `slurmd -N nI`. State, spool, pid and log files live in $FTKIT_SLURM_DIR (default
# /tmp/ftkit-slurm). The config is also copied to /etc/slurm/slurm.conf, where sinfo/sbatch/srun
# (also inside jobs) look for it; a foreign file there is kept as slurm.conf.ftkit-backup and put
# back by `down`. Env:
#   FTKIT_SLURM_NODES            node count when `up` gets none (default 5)
#   FTKIT_SLURM_DIR              state directory (default /tmp/ftkit-slurm)
#   FTKIT_SLURM_CPUS             CPUs per node (default 2: 2 tasks per node; oversubscribes cores)
#   FTKIT_SLURM_PORT             slurmctld port (default 6817); node nI listens on it + 10000 + I
#   FTKIT_SLURM_TIMEOUT          seconds to wait for the nodes (default 60)
#   FTKIT_SLURM_SLURMD_TIMEOUT   SlurmdTimeout (default 10)   } a dead slurmd's node is DOWN after
#   FTKIT_SLURM_MSG_TIMEOUT      MessageTimeout (default 5)   } ~13-22 s; with 5 and 3: ~12-14 s
#   FTKIT_SLURM_CRED_EXPIRE      AuthInfo cred_expire (default 5): a requeued job reruns ~6 s later
# A different node count or setting than the running cluster's makes `up` restart it.
# Needs root (daemons run as root: SlurmUser=SlurmdUser=root). No systemd and no cgroups are
# needed: proctrack/linuxproc, task/none. See slurm/NOTES.md for measured behaviour.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=_lib.sh source-path=SCRIPTDIR
. "$HERE/_lib.sh"

CPUS=${FTKIT_SLURM_CPUS:-2}
CTLD_PORT=${FTKIT_SLURM_PORT:-6817}
WAIT_S=${FTKIT_SLURM_TIMEOUT:-60}
SLURMD_TIMEOUT=${FTKIT_SLURM_SLURMD_TIMEOUT:-10}
CRED_EXPIRE=${FTKIT_SLURM_CRED_EXPIRE:-5}
MSG_TIMEOUT=${FTKIT_SLURM_MSG_TIMEOUT:-5}

# --- packages ---------------------------------------------------------------------------------

# Install Debian's slurm-wlm and munge when slurmctld is missing.
ensure_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sinfo >/dev/null && command -v munged >/dev/null; then
        return 0
    fi
    [ "$(id -u)" = 0 ] || die "slurm-wlm is not installed and installing it needs root"
    # apt's helpers (e.g. apt-key, the sandboxed download user) need a world-writable sticky /tmp.
    if [ "$(stat -c %a /tmp)" != 1777 ]; then
        log "fixing /tmp mode $(stat -c %a /tmp) -> 1777 (apt needs it)"
        chmod 1777 /tmp
    fi
    export DEBIAN_FRONTEND=noninteractive
    local t0=$SECONDS policy=/usr/sbin/policy-rc.d made_policy=0
    # Keep the packages' maintainer scripts from starting munged/slurmd themselves: this script
    # starts (and later stops) exactly the daemons it needs. Only if no policy exists already.
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 0755 "$policy"
        made_policy=1
        trap 'rm -f /usr/sbin/policy-rc.d' EXIT
    fi
    log "installing slurm-wlm and munge with apt-get"
    local rc=0
    apt-get update -q >"$SLURM_DIR/apt.log" 2>&1 \
        && apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=300 \
            slurm-wlm munge >>"$SLURM_DIR/apt.log" 2>&1 || rc=$?
    if [ "$made_policy" = 1 ]; then
        rm -f "$policy"
        trap - EXIT
    fi
    if [ "$rc" != 0 ]; then
        tail -n 20 "$SLURM_DIR/apt.log" >&2
        die "apt-get failed (rc=$rc, full log $SLURM_DIR/apt.log)"
    fi
    log "installed $(slurmctld -V) in $((SECONDS - t0)) s"
}

# --- munge ------------------------------------------------------------------------------------

munge_works() {
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1
}

# A usable munged: keep a working one; otherwise fix the key and directories and start one as
# the munge user, recording its pid so that `down` stops it (and only it).
ensure_munge() {
    if munge_works; then
        return 0
    fi
    local key=/etc/munge/munge.key
    if [ ! -s "$key" ]; then
        log "creating $key"
        mungekey --create --keyfile="$key"
    fi
    chown munge:munge "$key"
    chmod 0400 "$key"
    install -d -o munge -g munge -m 0700 /etc/munge
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged \
        || die "munged failed to start (see /var/log/munge/munged.log)"
    local deadline=$((SECONDS + 10))
    until munge_works; do
        [ "$SECONDS" -lt "$deadline" ] || die "munge -n | unmunge still fails 10 s after starting munged"
        sleep 0.2
    done
    # /run/munge/munged.pid is munged's own pid file; our copy marks "started by local-cluster".
    cp /run/munge/munged.pid "$RUN_DIR/munged.pid"
}

# --- config -----------------------------------------------------------------------------------

# gen_conf K: print the cluster's slurm.conf.
gen_conf() {
    local k=$1 host i
    host=$(hostname -s)
    {
        printf '%s\n' "$CONF_MARK"
        cat <<EOF
ClusterName=ftkit
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$SLURM_DIR/state
SlurmdSpoolDir=$SLURM_DIR/spool/%n
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmdPidFile=$RUN_DIR/slurmd.%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.%n.log
# no systemd, no cgroups here: track processes by their parent/child tree, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# take CPUs= below as given, whatever the host has (the nodes share its cores)
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
# scheduling passes every 2 s (default 60 s / backfill 30 s): a requeued job starts as soon as
# its BeginTime has passed instead of up to a minute later
SchedulerParameters=sched_interval=2,bf_interval=2
MpiDefault=none
# a DOWN node returns to service as soon as its slurmd registers again
ReturnToService=2
JobRequeue=1
# one task of an srun step exiting non-zero (or killed) ends the whole step
KillOnBadExit=1
# node failure detection: a node whose slurmd does not answer for SlurmdTimeout s is set DOWN
# (the controller pings every SlurmdTimeout/3 s, but a ping of a dead slurmd only fails after
# ~MessageTimeout+1 s and pings do not overlap); see slurm/NOTES.md for the measured delays
SlurmdTimeout=$SLURMD_TIMEOUT
MessageTimeout=$MSG_TIMEOUT
SlurmctldTimeout=10
KillWait=5
MinJobAge=300
InactiveLimit=0
MailProg=/bin/true
# a requeued job may start again cred_expire+1 s after the requeue (Slurm's default: 120 s)
AuthInfo=cred_expire=$CRED_EXPIRE
EOF
        for i in $(seq 1 "$k"); do
            printf 'NodeName=n%d NodeHostname=%s NodeAddr=127.0.0.1 Port=%d CPUs=%d State=UNKNOWN\n' \
                "$i" "$host" $((CTLD_PORT + 10000 + i)) "$CPUS"
        done
        printf 'PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n'
    }
}

# write_conf K: the cluster's slurm.conf into the state dir and /etc/slurm; the node list.
write_conf() {
    gen_conf "$1" >"$STATE_CONF"
    seq -f 'n%g' 1 "$1" >"$SLURM_DIR/nodes"
    install_etc_conf
}

# Copy our config to /etc/slurm/slurm.conf, keeping a foreign one as a backup.
install_etc_conf() {
    mkdir -p "$(dirname "$ETC_CONF")"
    if [ -e "$ETC_CONF" ] && [ "$(head -n 1 "$ETC_CONF")" != "$CONF_MARK" ]; then
        if [ -e "$ETC_BACKUP" ]; then
            die "$ETC_CONF is not ours and $ETC_BACKUP exists already; move one of them away"
        fi
        log "backing up $ETC_CONF to $ETC_BACKUP"
        mv "$ETC_CONF" "$ETC_BACKUP"
    fi
    cp "$STATE_CONF" "$ETC_CONF.ftkit-tmp"
    mv "$ETC_CONF.ftkit-tmp" "$ETC_CONF"
}

# Remove our /etc/slurm/slurm.conf and restore a backed-up foreign one.
restore_etc_conf() {
    if [ -e "$ETC_CONF" ] && [ "$(head -n 1 "$ETC_CONF")" = "$CONF_MARK" ]; then
        rm -f "$ETC_CONF"
    fi
    if [ -e "$ETC_BACKUP" ] && [ ! -e "$ETC_CONF" ]; then
        log "restoring $ETC_CONF from $ETC_BACKUP"
        mv "$ETC_BACKUP" "$ETC_CONF"
    fi
}

# --- daemons ----------------------------------------------------------------------------------

ctld_pid() { pid_from "$RUN_DIR/slurmctld.pid" slurmctld; }

# Print the last lines of the daemons' logs (for error reports).
log_tails() {
    local f
    for f in "$LOG_DIR"/slurmctld.log "$LOG_DIR"/slurmd.*.log; do
        [ -s "$f" ] || continue
        printf '\n--- tail of %s\n' "$f" >&2
        tail -n 15 "$f" >&2
    done
}

# nodes_ready: every configured node responds and is idle/mixed/allocated/completing.
nodes_ready() {
    local want got
    want=$(cluster_nodes | wc -l)
    got=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u \
        | awk '$2 == "idle" || $2 == "mix" || $2 == "alloc" || $2 == "comp"' | wc -l)
    [ "$want" -gt 0 ] && [ "$got" = "$want" ]
}

# wait_ready: poll sinfo until nodes_ready, or fail with the node states and log tails.
wait_ready() {
    local deadline=$((SECONDS + WAIT_S))
    until nodes_ready; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "nodes not all up after ${WAIT_S} s:"
            sinfo -N -o '%N %t %E' >&2 2>&1 || true
            log_tails
            die "timed out waiting for the cluster (logs in $LOG_DIR)"
        fi
        sleep 0.3
    done
}

# Start slurmd for every node whose daemon is not running; resume nodes left DOWN/DRAINED.
repair_nodes() {
    local node state
    for node in $(cluster_nodes); do
        if ! pid_from "$(slurmd_pidfile "$node")" slurmd >/dev/null; then
            log "starting slurmd for $node"
            start_slurmd "$node"
        fi
    done
    for node in $(cluster_nodes); do
        state=$(node_state "$node")
        case "$state" in
            down* | drain* | drng* | fail*)
                log "resuming $node (was $state)"
                scontrol update NodeName="$node" State=RESUME 2>/dev/null || true ;;
        esac
    done
}

up() {
    local k=${1:-${FTKIT_SLURM_NODES:-5}}
    if ! [[ $k =~ ^[0-9]+$ ]] || [ "$k" -lt 1 ] || [ "$k" -gt 999 ]; then
        die "bad node count '$k'"
    fi
    mkdir -p "$SLURM_DIR" "$RUN_DIR" "$LOG_DIR"
    ensure_packages
    ensure_munge

    if ctld_pid >/dev/null; then
        # running with the very config that would be written now (same K, same settings)?
        if cmp -s <(gen_conf "$k") "$STATE_CONF" && cmp -s "$STATE_CONF" "$ETC_CONF"; then
            repair_nodes
            wait_ready
            log "up: $k nodes (already running)"
            return 0
        fi
        log "running with $(cluster_nodes | wc -l) nodes or another config; restarting with $k nodes"
        down
        mkdir -p "$RUN_DIR" "$LOG_DIR"
        ensure_munge
    else
        # leftovers of a crashed controller (some slurmd still running): start from scratch
        stop_daemons
    fi

    local t0=$SECONDS node
    # a fresh cluster every time: no old jobs, node states or spool files
    rm -rf "$SLURM_DIR/state" "$SLURM_DIR/spool"
    rm -f "$LOG_DIR"/*.log
    mkdir -p "$SLURM_DIR/state" "$SLURM_DIR/spool"
    write_conf "$k"
    slurmctld -f "$STATE_CONF" -i || { log_tails; die "slurmctld failed to start"; }
    for node in $(cluster_nodes); do
        start_slurmd "$node"
    done
    wait_ready
    log "up: $k nodes idle after $((SECONDS - t0)) s (config $ETC_CONF, state $SLURM_DIR)"
    sinfo -N -o '%N %t %c' >&2 || true
}

# --- stopping ---------------------------------------------------------------------------------

# stop_pids PID...: SIGTERM them all, wait up to 10 s for them to exit, then SIGKILL the rest.
stop_pids() {
    [ "$#" -gt 0 ] || return 0
    local pid i still
    kill "$@" 2>/dev/null || true
    for i in $(seq 50); do
        still=()
        for pid in "$@"; do
            ! alive "$pid" || still+=("$pid")
        done
        [ "${#still[@]}" -gt 0 ] || return 0
        set -- "${still[@]}"
        sleep 0.2
    done
    log "pids $* ignored SIGTERM; killing them"
    kill -9 "$@" 2>/dev/null || true
}

# Stop the slurmd's and slurmctld started here (all at once: a slurmd takes ~2 s to exit), and
# any step daemons (with their job processes) that slurmd's killed earlier left behind. Munge
# is left alone.
stop_daemons() {
    local f pid node leftovers pids=()
    for f in "$RUN_DIR"/slurmd.*.pid; do
        [ -e "$f" ] || continue
        if pid=$(pid_from "$f" slurmd); then
            pids+=("$pid")
        fi
    done
    if pid=$(ctld_pid); then
        pids+=("$pid")
    fi
    stop_pids "${pids[@]}"
    rm -f "$RUN_DIR"/slurmd.*.pid "$RUN_DIR/slurmctld.pid"
    # orphaned slurmstepd's (their slurmd was killed, e.g. by kill-node.sh) and their tasks
    leftovers=()
    for node in $(cluster_nodes); do
        mapfile -t -O "${#leftovers[@]}" leftovers < <(node_stepds "$node")
    done
    if [ "${#leftovers[@]}" -gt 0 ]; then
        mapfile -t leftovers < <(descendants "${leftovers[@]}")
        log "killing ${#leftovers[@]} leftover step processes"
        kill -9 "${leftovers[@]}" 2>/dev/null || true
    fi
}

# Cancel all jobs of this cluster and wait (up to 20 s) until they have left the nodes.
cancel_jobs() {
    local jobs i
    jobs=$(squeue -h -o %i 2>/dev/null) || return 0
    [ -n "$jobs" ] || return 0
    log "cancelling jobs: $(echo "$jobs" | tr '\n' ' ')"
    # shellcheck disable=SC2086  # one job id per word
    scancel $jobs 2>/dev/null || true
    for i in $(seq 100); do
        [ -z "$(squeue -h -t RUNNING,COMPLETING -o %i 2>/dev/null)" ] && return 0
        sleep 0.2
    done
    log "jobs still running after 20 s; stopping the daemons anyway"
}

down() {
    local pid
    if ctld_pid >/dev/null; then
        cancel_jobs
    fi
    stop_daemons
    if pid=$(pid_from "$RUN_DIR/munged.pid" munged); then
        log "stopping munged (started by local-cluster)"
        stop_pids "$pid"
    fi
    rm -f "$RUN_DIR/munged.pid"
    restore_etc_conf
    log "down"
}

# --- status -----------------------------------------------------------------------------------

status() {
    local pid node
    if ! pid=$(ctld_pid); then
        echo "local-cluster: down (no slurmctld from $RUN_DIR)"
        return 1
    fi
    echo "slurmctld pid $pid, config $ETC_CONF, state $SLURM_DIR"
    if ! sinfo -N -o '%10N %8t %4c %10P %E'; then
        echo "local-cluster: slurmctld does not answer"
        return 1
    fi
    for node in $(cluster_nodes); do
        if pid=$(pid_from "$(slurmd_pidfile "$node")" slurmd); then
            printf '%s slurmd pid %s\n' "$node" "$pid"
        else
            printf '%s slurmd not running\n' "$node"
        fi
    done
    nodes_ready || return 2
}

case "${1:-}" in
    up) up "${2:-}" ;;
    down) down ;;
    status) status ;;
    *)
        echo "usage: $0 up [K] | down | status" >&2
        exit 64 ;;
esac
