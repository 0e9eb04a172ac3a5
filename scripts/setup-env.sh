#!/usr/bin/env bash
# Create (or update) the project's virtual environment: ftkit + test tools, MPI from PyPI
# (Open MPI 5 wheel + mpi4py 4), and the CPU build of torch 2.13.0.
# A torch that is already importable in the venv (e.g. a cluster's CUDA build) is kept.
# Usage: scripts/setup-env.sh            (venv at ./.venv, or $FTKIT_VENV)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FTKIT_VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip -q --disable-pip-version-check)
stamp="$VENV/.ftkit-setup-$(cat setup.cfg pyproject.toml scripts/setup-env.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
    exit 0
fi
"${PIP[@]}" install --upgrade pip 2>&1 | grep -v "is ignored" || true
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    echo "setup: installing torch==2.13.0 (CPU)" >&2
    "${PIP[@]}" install "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
fi
echo "setup: installing ftkit[test] (mpi4py, Open MPI, pytest, ...)" >&2
"${PIP[@]}" install -e ".[test]" 2>&1 | grep -v "is ignored" || true
# optional: ISA-L for the rs level's GF(256) arithmetic (its tests skip without it)
"${PIP[@]}" install -e ".[isal]" 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('pyeclib') is None)" \
    || echo "setup: pyeclib (ISA-L) not installed; the rs level's GF(256) runs on NumPy" >&2
"$VENV/bin/python" -c "import torch, torchdata.stateful_dataloader, mpi4py, numpy, xxhash, pytest, ftkit" \
    || { echo "setup: the environment is incomplete" >&2; exit 1; }
rm -f "$VENV"/.ftkit-setup-*
touch "$stamp"
