"""One job, one writer (ftkit.joblock): a second instance of a running job is refused at once,
whether launched by ``ftkit run`` or by ``mpiexec`` directly, and the first ends bit-exact; a
holder that was killed does not block the next run, which resumes its steps.

Before the fix, two ``ftkit run`` of one job both exited 0 with a digest that matched
neither run, one of them resuming the other's step.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ftkit.joblock import LOCK_FILE, held_by
from tests.e2e.jobs import FTKIT, TOY, job_env, run_toy

LEVELS = "local:1,partner:1"


def _start(tmp: Path, steps: int, seed: int = 1, **env: str) -> subprocess.Popen[str]:
    cmd = [*FTKIT, "run", "-n", "4", "--ranks-per-node", "2", "--max-restarts", "0",
           "--attempt-timeout", "300", "--", sys.executable, str(TOY), "--steps", str(steps),
           "--seed", str(seed)]
    return subprocess.Popen(cmd, cwd=tmp, env=job_env(tmp, FTKIT_LEVELS=LEVELS, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_until_running(tmp: Path, first: subprocess.Popen[str]) -> None:
    """Until both node leaders of the first run hold their node-local locks (its job has
    started), checked every 50 ms for at most 120 s; fails if the first run ends first."""
    locks = [tmp / "local" / "e2e" / f"node-{n}" / LOCK_FILE for n in (0, 1)]
    deadline = time.monotonic() + 120
    while not all(held_by(p) is not None for p in locks):
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline, "the first run never took its node-local locks"
        time.sleep(0.05)


def _kill_session(proc: subprocess.Popen[str], tmp: Path) -> None:
    """SIGKILL ``ftkit run`` and every process of the job (its attempts run in sessions of
    their own): what a crashed login node or ``kill -9`` leaves."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    mark = str(tmp).encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except OSError:
            continue


@pytest.mark.timeout(600)
def test_second_instance_of_a_running_job_is_refused(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    first = _start(tmp_path, steps=40)
    try:
        _wait_until_running(tmp_path, first)
        second = run_toy(tmp_path, steps=40, seed=2, max_restarts=2, FTKIT_LEVELS=LEVELS)
        assert second.rc == 2, second.tail()
        assert not second.attempt_lines(), second.tail()
        assert "job e2e is already running" in second.stderr, second.tail()
        assert f"ftkit run pid {first.pid} on host" in second.stderr, second.tail()
        assert "another FTKIT_JOB" in second.stderr
        mpiexec = Path(sys.executable).parent / "mpiexec"
        direct = subprocess.run(
            [str(mpiexec), "-n", "4", "--oversubscribe", "--bind-to", "none", sys.executable,
             "-m", "mpi4py", str(TOY), "--steps", "40", "--seed", "2"], cwd=tmp_path,
            env=job_env(tmp_path, FTKIT_LEVELS=LEVELS, FTKIT_RANKS_PER_NODE="2"),
            capture_output=True, text=True, timeout=300, check=False)
        assert direct.returncode != 0, direct.stdout[-2000:]
        assert "JobLockedError: rank 0: job e2e is already running: node leader of node 0" \
            in direct.stderr, direct.stderr[-4000:]
        out, err = first.communicate(timeout=400)
    finally:
        if first.poll() is None:
            _kill_session(first, tmp_path)
    assert first.returncode == 0, (out[-3000:], err[-3000:])
    done = [ln for ln in out.splitlines() if ln.startswith('{"event": "done"')]
    assert done and f'"digest": "{reference_digest(4, 40)}"' in done[-1], out[-2000:]


@pytest.mark.timeout(600)
def test_killed_holder_does_not_block_the_next_run(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """``ftkit run`` and its job are SIGKILLed mid-run, locks held: the next ``ftkit run`` of
    the job starts at once, resumes a committed step and ends bit-exact."""
    first = _start(tmp_path, steps=40)
    try:
        _wait_until_running(tmp_path, first)
    finally:
        _kill_session(first, tmp_path)
    res = run_toy(tmp_path, steps=40, max_restarts=0, FTKIT_LEVELS=LEVELS)
    assert res.rc == 0, res.tail()
    assert "already running" not in res.stderr
    assert res.done["digest"] == reference_digest(4, 40), res.tail()
