#!/usr/bin/env bash
# Demo: an 8-rank data-parallel training job on 4 virtual nodes loses a whole node (its ranks
# are killed and its node-local checkpoint directory is wiped) in the middle of a checkpoint.
# ftkit run relaunches the job, restore rebuilds the lost node's shards from the partner
# copies held on the next node (over MPI), and the final model is bit-identical to a
# failure-free run, which the demo also runs. Sets up .venv first.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-env.sh
VENV=${FTKIT_VENV:-.venv}
PY="$PWD/$VENV/bin/python"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ftkit-demo.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
STEPS=${STEPS:-30}
run() {  # run <job> [FTKIT_FAULTS]
    FTKIT_JOB=$1 FTKIT_FAULTS=${2:-} FTKIT_LEVELS=local:1,partner:1,xor:4 \
    FTKIT_LOCAL_DIR="$WORK/local" FTKIT_PFS_DIR="$WORK/pfs" \
    "$PY" -m ftkit.cli.main run -n 8 --ranks-per-node 2 \
        --max-restarts 2 --attempt-timeout 600 -- \
        "$PY" examples/toy_dp.py --steps "$STEPS" --seed 7 2>"$WORK/$1.err" | tee "$WORK/$1.out" \
        | grep -E '^ftkit run:|"event": "(start|done)"' || true
    # the dying job's stderr is long (every peer reports the lost connection): show ftkit's lines
    grep -aE '^ftkit\[|prterun noticed|injected fault' "$WORK/$1.err" | sed 's/^/  stderr| /' || true
}
digest() { grep '"event": "done"' "$WORK/$1.out" | tail -1 | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["digest"])'; }

echo "== 1. failure-free reference run ($STEPS steps, 8 ranks on 4 virtual nodes," \
     "levels local:1,partner:1,xor:4)"
run reference
echo
echo "== 2. the same run; node 1 (ranks 2, 3) dies and loses its disk while step 17 is encoded"
run faulty "node:rank=2:step=17:phase=encode"
echo
echo "== events.jsonl of the faulty run (restore / relaunch decisions)"
grep -E '"event": "(restore|restore-skip|rebuild|attempt-end|relaunch|done)"' "$WORK/pfs/faulty/events.jsonl" \
    | "$PY" -c 'import json,sys
for line in sys.stdin:
    e = json.loads(line)
    keep = {k: e[k] for k in ("event", "attempt", "step", "rc", "reason", "nodes", "from_partner", "seconds") if k in e}
    print("  ", keep)'
ref=$(digest reference); got=$(digest faulty)
echo
echo "reference digest: $ref"
echo "recovered digest: $got"
if [ -n "$ref" ] && [ "$ref" = "$got" ]; then
    echo "OK: the recovered run is bit-identical to the failure-free run"
else
    echo "MISMATCH: the recovered run differs from the failure-free run" >&2
    exit 1
fi
