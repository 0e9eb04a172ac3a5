#!/usr/bin/env bash
# Demo: a hybrid-parallel GPT (dp2 x tp2 x pp2 = 8 ranks on 4 virtual nodes, gloo on CPU)
# loses a whole node (its two ranks are killed and its node-local checkpoint directory is
# wiped) in the middle of a checkpoint. `ftkit run` relaunches the job, restore rebuilds the
# lost shards from the partner copies held on another node (over MPI), training resumes,
# and the final model is bit-identical to a failure-free run, which the demo also runs.
# Sets up .venv first.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-env.sh
VENV=${FTKIT_VENV:-.venv}
PY="$PWD/$VENV/bin/python"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ftkit-demo.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
STEPS=${STEPS:-24}
FAULT_STEP=${FAULT_STEP:-15}
run() {  # run <job> [FTKIT_FAULTS]
    FTKIT_JOB=$1 FTKIT_FAULTS=${2:-} FTKIT_LEVELS=local:1,partner:1 \
    FTKIT_LOCAL_DIR="$WORK/local" FTKIT_PFS_DIR="$WORK/pfs" \
    "$PY" -m ftkit.cli.main run -n 8 --ranks-per-node 2 \
        --max-restarts 2 --attempt-timeout 600 -- \
        "$PY" examples/hp_gpt.py --dp 2 --tp 2 --pp 2 --steps "$STEPS" --seed 7 \
        2>"$WORK/$1.err" | tee "$WORK/$1.out" | grep -E '^ftkit run:|"event": "start"' || true
    # the dying job's stderr is long (every peer reports the lost connection): show ftkit's lines
    grep -aE '^ftkit\[|prterun noticed|injected fault' "$WORK/$1.err" | sed 's/^/  stderr| /' || true
}

echo "== 1. failure-free reference run ($STEPS steps; dp2 x tp2 x pp2 on 4 virtual nodes;" \
     "levels local:1,partner:1)"
run reference
echo
echo "== 2. the same run; node 1 (ranks 2, 3) dies and loses its disk while step $FAULT_STEP" \
     "is encoded"
run faulty "node:rank=2:step=$FAULT_STEP:phase=encode"
echo
"$PY" scripts/demo_report.py "$WORK/reference.out" "$WORK/faulty.out" \
    "$WORK/pfs/faulty/events.jsonl"
