#!/usr/bin/env bash
# Simulate the failure of one virtual node of the local cluster (slurm/local-cluster.sh):
#
#   slurm/kill-node.sh [--no-mark-down] nI
#
# 1. collects every process of that node: its slurmstepd's (found by their listening sockets in
#    the node's spool dir, which works after the slurmd is gone too) with all their descendants
#    (batch script, srun tasks, mpiexec's prted daemons and the ranks they fork), plus strays
#    whose environment says SLURMD_NODENAME=nI (e.g. double-forked ones) unless they descend
#    from another node's slurmstepd. The environment alone would be wrong: a job's HOSTNAME, and
#    whatever the batch script exported, are those of the batch node on every node;
# 2. freezes them all (SIGSTOP), SIGKILLs that node's slurmd, then SIGKILLs them, so that no
#    process of the node gets to report or clean up, as when a machine dies;
# 3. marks the node down at once: scontrol update NodeName=nI State=DOWN Reason=ftkit-test.
#    With --no-mark-down it leaves the detection to Slurm (SlurmdTimeout; see NOTES.md).
#
# Prints what it killed; exit 0 on success. slurm/revive-node.sh nI brings the node back.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=_lib.sh source-path=SCRIPTDIR
. "$HERE/_lib.sh"

mark_down=1
if [ "${1:-}" = --no-mark-down ]; then
    mark_down=0
    shift
fi
[ "$#" = 1 ] || { echo "usage: $0 [--no-mark-down] NODE" >&2; exit 64; }
node=$1
valid_node "$node" || die "$node is not a node of the cluster in $SLURM_DIR ($(cluster_nodes | tr '\n' ' '))"

# victims: print the pids of every process that belongs to $node (see the header).
victims() {
    local pid stepds=() foreign=()
    # one look at all step daemons: this node's, and the others' (never victims, nor anything
    # that descends from them)
    mapfile -t stepds < <(stepd_nodes)
    mapfile -t foreign < <(printf '%s\n' "${stepds[@]}" | awk -v n="$node" 'NF == 2 && $2 != n { print $1 }')
    mapfile -t stepds < <(printf '%s\n' "${stepds[@]}" | awk -v n="$node" 'NF == 2 && $2 == n { print $1 }')
    if [ "${#foreign[@]}" -gt 0 ]; then
        mapfile -t foreign < <(descendants "${foreign[@]}")
    fi
    {
        descendants "${stepds[@]}"
        for pid in $(grep -lsxF "SLURMD_NODENAME=$node" --null-data /proc/[0-9]*/environ \
            | tr '\0' '\n' | cut -d/ -f3); do
            [ "$pid" != "$$" ] || continue
            printf '%s\n' "$pid"
        done
    } | sort -un | grep -vxF -f <(printf '%s\n' "${foreign[@]}" 0) | while read -r pid; do
        # zombies wait for the sandbox's init to reap them: nothing left to kill there
        if alive "$pid"; then printf '%s\n' "$pid"; fi
    done
}

# describe PID...: "pid(comm) ..." of the live ones
describe() {
    ps -o pid=,comm= -p "$(IFS=,; echo "$*")" 2>/dev/null | awk '{printf "%s(%s) ", $1, $2}'
}

t0=$(date +%s%N)
mapfile -t pids < <(victims)
if [ "${#pids[@]}" -gt 0 ]; then
    # freeze first so that none of them reacts to the others' deaths before all are killed
    kill -STOP "${pids[@]}" 2>/dev/null || true
fi
if slurmd_pid=$(pid_from "$(slurmd_pidfile "$node")" slurmd); then
    kill -9 "$slurmd_pid"
    echo "kill-node: $node: killed slurmd $slurmd_pid"
else
    echo "kill-node: $node: slurmd was not running"
fi
killed=0
# a few rounds: a process forked between the listing and the freeze is caught by the next one
for _ in 1 2 3; do
    [ "${#pids[@]}" -gt 0 ] || break
    echo "kill-node: $node: killing ${#pids[@]} job processes: $(describe "${pids[@]}")"
    kill -9 "${pids[@]}" 2>/dev/null || true
    killed=$((killed + ${#pids[@]}))
    sleep 0.1
    mapfile -t pids < <(victims)
done
if [ "${#pids[@]}" -gt 0 ]; then
    die "processes of $node survived: ${pids[*]}"
fi
if [ "$mark_down" = 1 ]; then
    scontrol update NodeName="$node" State=DOWN Reason=ftkit-test
    echo "kill-node: $node: marked DOWN (Reason=ftkit-test)"
fi
echo "kill-node: $node: done in $(( ($(date +%s%N) - t0) / 1000000 )) ms ($killed processes)"
