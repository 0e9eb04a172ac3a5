#!/usr/bin/env bash
# Run the whole test suite (unit, MPI tier under mpiexec, e2e fault injection).
# Sets up .venv first. Extra arguments go to pytest, e.g.  scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-env.sh
VENV=${FTKIT_VENV:-.venv}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec "$VENV/bin/python" -m pytest tests -p no:cacheprovider -ra "$@"
