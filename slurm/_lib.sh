# shellcheck shell=bash
# Shared helpers for slurm/local-cluster.sh, kill-node.sh and revive-node.sh (sourced, not run).
# All state of the local cluster lives in one private directory:
#   $FTKIT_SLURM_DIR (default /tmp/ftkit-slurm)
#     slurm.conf             the cluster's config (copied to /etc/slurm/slurm.conf for the tools)
#     nodes                  the node names, one a line (n1..nK)
#     state/                 slurmctld StateSaveLocation
#     spool/<node>/          each slurmd's SlurmdSpoolDir
#     run/*.pid              pid files of the daemons started by local-cluster.sh
#     log/*.log              slurmctld.log, slurmd.<node>.log

# shellcheck disable=SC2034  # the variables below are used by the scripts that source this file
FTKIT_SLURM_DIR=${FTKIT_SLURM_DIR:-/tmp/ftkit-slurm}
SLURM_DIR=$FTKIT_SLURM_DIR
RUN_DIR=$SLURM_DIR/run
LOG_DIR=$SLURM_DIR/log
STATE_CONF=$SLURM_DIR/slurm.conf
# The Slurm commands (sinfo, sbatch, srun inside jobs, ...) read this path unless SLURM_CONF is
# set; Debian's slurm-wlm is built with /etc/slurm as its config directory.
ETC_CONF=/etc/slurm/slurm.conf
ETC_BACKUP=/etc/slurm/slurm.conf.ftkit-backup
# First line of every slurm.conf written here: tells ours from someone else's.
CONF_MARK="# ftkit local-cluster (slurm/local-cluster.sh) - generated, do not edit"
log() { printf 'local-cluster: %s\n' "$*" >&2; }
die() { printf 'local-cluster: error: %s\n' "$*" >&2; exit 1; }

# alive PID: the process exists and is not a zombie (the sandbox's init reaps killed daemons
# only every few seconds, so /proc/PID alone is not enough).
alive() {
    local state
    state=$(sed -n 's/^[0-9]* (.*) \([A-Za-z]\) .*/\1/p' "/proc/$1/stat" 2>/dev/null) || return 1
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

# pid_from FILE NAME: print the pid in FILE if that process is alive and its comm is NAME
# (guards against a stale pid file whose pid was reused by another program).
pid_from() {
    local file=$1 name=$2 pid comm
    [ -s "$file" ] || return 1
    pid=$(tr -dc '0-9' <"$file")
    [ -n "$pid" ] || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [ "$comm" = "$name" ] && alive "$pid" || return 1
    printf '%s\n' "$pid"
}

# The node names of the configured cluster (empty if none).
cluster_nodes() {
    [ -s "$SLURM_DIR/nodes" ] && cat "$SLURM_DIR/nodes"
    return 0
}

# valid_node NAME: NAME is a node of the configured cluster.
valid_node() {
    grep -qx -- "$1" "$SLURM_DIR/nodes" 2>/dev/null
}

slurmd_pidfile() { printf '%s/slurmd.%s.pid\n' "$RUN_DIR" "$1"; }

# start_slurmd NODE: start that node's slurmd (it daemonizes and writes its pid file).
start_slurmd() {
    local node=$1
    mkdir -p "$SLURM_DIR/spool/$node"
    slurmd -f "$STATE_CONF" -N "$node" \
        || die "slurmd -N $node failed to start (see $LOG_DIR/slurmd.$node.log)"
    # the daemonized slurmd writes its pid file a moment later
    local i
    for i in $(seq 50); do
        pid_from "$(slurmd_pidfile "$node")" slurmd >/dev/null && return 0
        sleep 0.1
    done
    die "slurmd -N $node wrote no pid file (see $LOG_DIR/slurmd.$node.log)"
}

# node_state NODE: Slurm's short state of NODE (idle, alloc, mix, down*, drain, ...).
node_state() {
    sinfo -h -N -n "$1" -o '%t' 2>/dev/null | head -n 1
}

# stepd_nodes: print "PID NODE" for every slurmstepd of this cluster (alive, or orphaned after
# its slurmd died). Slurm gives slurmstepd a scrubbed environment and the log dir as cwd, so
# neither tells the node; but each one listens on a unix socket <SlurmdSpoolDir>/<node>_<job>.<step>,
# i.e. under spool/<node>/ here: join the socket inodes of /proc/net/unix with the stepds' fds.
stepd_nodes() {
    local pid fd
    {
        awk -v dir="$SLURM_DIR/spool/" 'index($8, dir) == 1 {
            n = split(substr($8, length(dir) + 1), part, "/")
            if (n == 2 && index(part[2], part[1] "_") == 1) print "S", "socket:[" $7 "]", part[1]
        }' /proc/net/unix
        for pid in $(pgrep -x slurmstepd || true); do
            for fd in "/proc/$pid/fd/"*; do
                printf 'P %s %s\n' "$(readlink "$fd" 2>/dev/null)" "$pid"
            done
        done
    } | awk '$1 == "S" { node[$2] = $3; next }
             $1 == "P" && ($2 in node) && !seen[$3]++ { print $3, node[$2] }'
}

# node_stepds NODE: pids of the slurmstepd's of NODE (see stepd_nodes).
node_stepds() {
    stepd_nodes | awk -v n="$1" '$2 == n { print $1 }'
}

# descendants PID...: print the given (live) pids and all their descendants.
descendants() {
    [ "$#" -gt 0 ] || return 0
    ps -e -o pid=,ppid= | awk -v roots="$*" '
        BEGIN { n = split(roots, r, " "); for (i = 1; i <= n; i++) keep[r[i]] = 1 }
        { parent[$1] = $2; pids[NR] = $1 }
        END {
            do {
                changed = 0
                for (i in pids) {
                    p = pids[i]
                    if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; changed = 1 }
                }
            } while (changed)
            for (p in keep) if (p in parent) print p
        }'
}
