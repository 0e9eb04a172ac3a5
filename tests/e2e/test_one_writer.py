"""One job, one writer (ftkit.jobdir.lock): a second instance of a running job is refused at once,
whether launched by ``ftkit run`` or by ``mpiexec`` directly, and the first ends bit-exact; a
holder that was killed does not block the next run, which resumes its steps.

Before the fix, two ``ftkit run`` of one job both exited 0 with a digest that matched
neither run, one of them resuming the other's step.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ftkit.jobdir.lock import LOCK_FILE, held_by
from tests.e2e.jobs import FTKIT, TOY, job_env, run_toy

LEVELS = "local:1,partner:1"


HOOKS = Path(__file__).resolve().parent / "toy_hooks.py"


def _start(tmp: Path, steps: int, hold_at: int, **env: str
           ) -> tuple[subprocess.Popen[str], Path]:
    """``ftkit run`` the toy (seed 1) so that it holds still before the save of ``hold_at``
    until the returned file exists; returns once it holds (its locks taken, mid-run).
    ``env``: more variables of the job."""
    until = tmp / "release"
    cmd = [*FTKIT, "run", "-n", "4", "--ranks-per-node", "2", "--max-restarts", "0",
           "--attempt-timeout", "300", "--", sys.executable, str(HOOKS), "--steps", str(steps),
           "--seed", "1"]
    proc = subprocess.Popen(cmd, cwd=tmp, env=job_env(tmp, FTKIT_LEVELS=LEVELS,
                                                      HOLD_AT=str(hold_at),
                                                      HOLD_UNTIL=str(until), **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    held = until.with_name(until.name + ".held")
    deadline = time.monotonic() + 120
    while not held.exists():            # the job signals it; checked every 50 ms
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the first run never reached its hold"
        time.sleep(0.05)
    return proc, until


def _kill_session(proc: subprocess.Popen[str], tmp: Path) -> None:
    """SIGKILL ``ftkit run`` and every process of the job (its attempts run in sessions of
    their own): what a crashed login node or ``kill -9`` leaves."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    mark = str(tmp).encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except OSError:
            continue
    proc.communicate(timeout=60)        # EOF once every process holding its pipes is gone


@pytest.mark.timeout(600)
def test_second_instance_of_a_running_job_is_refused(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """The first run holds still before the save of step 12 (steps 1-11 committed): another
    ``ftkit run`` of the job exits 2 before launching, naming the holder; a direct
    ``mpiexec`` launch is refused by the node-local locks (JobLockedError on every rank).
    Released, the first run ends bit-exact."""
    first, release = _start(tmp_path, steps=20, hold_at=12)
    try:
        locks = [tmp_path / "local" / "e2e" / f"node-{n}" / LOCK_FILE for n in (0, 1)]
        assert all(held_by(p) is not None for p in locks)
        second = run_toy(tmp_path, steps=20, seed=2, max_restarts=2, FTKIT_LEVELS=LEVELS)
        assert second.rc == 2, second.tail()
        assert not second.attempt_lines(), second.tail()
        assert "job e2e is already running" in second.stderr, second.tail()
        assert f"ftkit run pid {first.pid} on host" in second.stderr, second.tail()
        assert "another FTKIT_JOB" in second.stderr
        mpiexec = Path(sys.executable).parent / "mpiexec"
        direct = subprocess.run(
            [str(mpiexec), "-n", "4", "--oversubscribe", "--bind-to", "none", sys.executable,
             "-m", "mpi4py", str(TOY), "--steps", "20", "--seed", "2"], cwd=tmp_path,
            env=job_env(tmp_path, FTKIT_LEVELS=LEVELS, FTKIT_RANKS_PER_NODE="2"),
            capture_output=True, text=True, timeout=300, check=False)
        assert direct.returncode != 0, direct.stdout[-2000:]
        assert "JobLockedError: rank 0: job e2e is already running: node leader of node 0" \
            in direct.stderr, direct.stderr[-4000:]
        assert '"event": "start"' not in direct.stdout
        release.touch()
        out, err = first.communicate(timeout=400)
    finally:
        if first.poll() is None:
            _kill_session(first, tmp_path)
    assert first.returncode == 0, (out[-3000:], err[-3000:])
    done = [ln for ln in out.splitlines() if ln.startswith('{"event": "done"')]
    assert done and f'"digest": "{reference_digest(4, 20)}"' in done[-1], out[-2000:]


@pytest.mark.timeout(600)
def test_killed_ftkit_run_takes_its_job_with_it(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """``ftkit run`` alone is SIGKILLed while its job holds still before the save of step 12
    (an OOM killer, a closed terminal): the launcher gets its parent-death signal and the
    ranks end, releasing the node-local locks, within seconds; ``ftkit status`` says the job
    is not running; the next ``ftkit run`` starts at once, resumes step 11 and ends
    bit-exact. (Before, the ranks trained on and the next run was refused after launching.)"""
    # the ranks waiting for rank 0 would end by themselves after FTKIT_TIMEOUT: not here
    first, _release = _start(tmp_path, steps=20, hold_at=12, FTKIT_TIMEOUT="600")
    locks = [tmp_path / "local" / "e2e" / f"node-{n}" / LOCK_FILE for n in (0, 1)]
    try:
        os.kill(first.pid, signal.SIGKILL)             # ftkit run only, not its job
        first.wait(timeout=60)
        deadline = time.monotonic() + 15
        while any(held_by(p) is not None for p in locks):
            assert time.monotonic() < deadline, [held_by(p) for p in locks]
            time.sleep(0.1)
    finally:
        _kill_session(first, tmp_path)
    status = subprocess.run([*FTKIT, "status", "e2e"], cwd=tmp_path, env=job_env(tmp_path),
                            capture_output=True, text=True, timeout=60, check=True)
    assert status.stdout.startswith("job e2e: not running;"), status.stdout
    res = run_toy(tmp_path, steps=20, max_restarts=0, FTKIT_LEVELS=LEVELS)
    assert res.rc == 0, res.tail()
    assert "already running" not in res.stderr and "took over" not in res.stderr
    assert "still hold" not in res.stderr, res.tail()
    assert res.starts[0]["step"] == 11, res.tail()
    assert res.done["digest"] == reference_digest(4, 20), res.tail()
