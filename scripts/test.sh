#!/usr/bin/env bash
# Run the test suite. Sets up .venv first. Extra arguments go to pytest.
#
#   scripts/test.sh                 the whole suite: unit, MPI tier (mpiexec -n 4), e2e (CI runs this)
#   scripts/test.sh --fast          unit tests + the MPI tier; no e2e jobs, nothing marked slow
#   scripts/test.sh -m "not slow"   everything but the long fault-matrix, Slurm and benchmark cases
#   scripts/test.sh --fast -k restore   extra arguments still apply; a -m EXPR given with
#                                       --fast is combined with it ("not e2e and not slow and (EXPR)")
#
# Markers (pyproject.toml): e2e = launches real jobs (every test under tests/e2e, set by
# tests/conftest.py, and the benchmark smoke run); slow = long cases.
set -euo pipefail
cd "$(dirname "$0")/.."
FAST_EXPR="not e2e and not slow"
fast=0
marker=""
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --fast) fast=1 ;;
        -m) [ $# -ge 2 ] || { echo "scripts/test.sh: -m needs an expression" >&2; exit 2; }
            marker="$2"; shift ;;
        -m*) marker="${1#-m}" ;;
        *) args+=("$1") ;;
    esac
    shift
done
if [ "$fast" = 1 ]; then
    marker="$FAST_EXPR${marker:+ and ($marker)}"
fi
[ -z "$marker" ] || args=(-m "$marker" "${args[@]+"${args[@]}"}")
scripts/setup-env.sh
VENV=${FTKIT_VENV:-.venv}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec "$VENV/bin/python" -m pytest tests -p no:cacheprovider -ra "${args[@]+"${args[@]}"}"
