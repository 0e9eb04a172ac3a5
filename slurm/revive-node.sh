#!/usr/bin/env bash
# Bring back a virtual node of the local cluster after slurm/kill-node.sh:
#
#   slurm/revive-node.sh nI
#
# Starts that node's slurmd (unless it runs), waits until the controller hears from it, resumes
# the node if it is still DOWN/DRAINED (scontrol update NodeName=nI State=RESUME) and waits (up
# to $FTKIT_SLURM_TIMEOUT s, default 30) until it is usable (idle/mix/alloc). Exit 0 when it is.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=_lib.sh source-path=SCRIPTDIR
. "$HERE/_lib.sh"

[ "$#" = 1 ] || { echo "usage: $0 NODE" >&2; exit 64; }
node=$1
valid_node "$node" || die "$node is not a node of the cluster in $SLURM_DIR ($(cluster_nodes | tr '\n' ' '))"
wait_s=${FTKIT_SLURM_TIMEOUT:-30}

t0=$(date +%s%N)
if pid=$(pid_from "$(slurmd_pidfile "$node")" slurmd); then
    echo "revive-node: $node: slurmd already running (pid $pid)"
else
    start_slurmd "$node"
    echo "revive-node: $node: started slurmd $(pid_from "$(slurmd_pidfile "$node")" slurmd || echo '?')"
fi

deadline=$((SECONDS + wait_s))
resumed=0
while :; do
    state=$(node_state "$node")
    case "$state" in
        idle | mix | alloc | comp) break ;;
        # answering but still marked down/drained: resume it (once)
        down | drain | drng | fail | idle+drain | down+drain)
            if [ "$resumed" = 0 ]; then
                scontrol update NodeName="$node" State=RESUME 2>/dev/null || true
                resumed=1
            fi ;;
    esac
    if [ "$SECONDS" -ge "$deadline" ]; then
        sinfo -N -n "$node" -o '%N %t %E' >&2 || true
        tail -n 15 "$LOG_DIR/slurmd.$node.log" >&2 || true
        die "$node is '$state' ${wait_s} s after restarting its slurmd"
    fi
    sleep 0.2
done
echo "revive-node: $node: $state after $(( ($(date +%s%N) - t0) / 1000000 )) ms"
