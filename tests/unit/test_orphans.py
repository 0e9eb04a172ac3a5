"""A job does not outlive its ``ftkit run`` (ftkit.launch.orphans): the launcher gets the
parent-death signal when ``ftkit run`` is SIGKILLed, and a run that finds the job's
node-local locks still held waits for them, then refuses naming the holder. Real processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ftkit.errors import JobLockedError
from ftkit.jobdir.deathsig import die_with
from ftkit.jobdir.lock import LOCK_FILE, JobLock, holder_record
from ftkit.launch.orphans import held_locks, wait_for_orphans
from ftkit.testing.procs import process_gone

MIDDLE = """
import subprocess, sys, os
from ftkit.jobdir.deathsig import die_with
child = subprocess.Popen(["sleep", "600"], start_new_session=True,
                         preexec_fn=die_with(os.getpid()))
print(child.pid, flush=True)
sys.stdin.read()
"""


def test_the_launcher_dies_with_ftkit_run() -> None:
    assert die_with(os.getpid()) is not None, "no parent-death signal on this platform"
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert middle.stdout is not None
    child = int(middle.stdout.readline())
    try:
        assert not process_gone(child)
        middle.send_signal(signal.SIGKILL)             # ftkit run killed, its launcher not
        middle.wait(timeout=30)
        deadline = time.monotonic() + 10
        while not process_gone(child):
            assert time.monotonic() < deadline, "the launcher outlived its ftkit run"
            time.sleep(0.05)
    finally:
        if not process_gone(child):
            os.kill(child, signal.SIGKILL)


ME = holder_record("ftkit run", env={})


def _leader(job_local: Path, node: int) -> JobLock:
    lock = JobLock(job_local / f"node-{node}" / LOCK_FILE, "j")
    lock.path.parent.mkdir(parents=True, exist_ok=True)
    lock.acquire(holder_record(f"node leader of node {node}", env={}), what="test")
    return lock


def test_a_node_lock_still_held_is_waited_for_then_refused(tmp_path: Path) -> None:
    job_local = tmp_path / "local" / "j"
    wait_for_orphans("j", job_local, ME, grace=0.1)        # nothing there: at once
    lock = _leader(job_local, 1)
    try:
        assert list(held_locks(job_local)) == [job_local / "node-1" / LOCK_FILE]
        with pytest.raises(JobLockedError) as err:
            wait_for_orphans("j", job_local, ME, grace=0.3)
    finally:
        lock.release()
    msg = str(err.value)
    assert "no ftkit run holds it, but its ranks still run on this host" in msg
    assert f"node leader of node 1 pid {os.getpid()}" in msg and "kill the pids" in msg
    assert held_locks(job_local) == {}


def test_a_requeued_slurm_jobs_node_lock_is_left_to_its_takeover(tmp_path: Path) -> None:
    """A node leader of the previous instance of a requeued Slurm job may still hold its
    lock: the new instance's node leaders take it over (ftkit.jobdir.lock), so ftkit run does
    not wait for it."""
    job_local = tmp_path / "local" / "j"
    lock = JobLock(job_local / "node-0" / LOCK_FILE, "j")
    lock.path.parent.mkdir(parents=True)
    lock.acquire(holder_record("node leader of node 0",
                               env={"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"}),
                 what="test")
    try:
        requeued = holder_record("ftkit run", env={"SLURM_JOB_ID": "7",
                                                   "SLURM_RESTART_COUNT": "1"})
        t0 = time.monotonic()
        wait_for_orphans("j", job_local, requeued, grace=30)
        assert time.monotonic() - t0 < 5
        with pytest.raises(JobLockedError):
            wait_for_orphans("j", job_local, ME, grace=0.1)
    finally:
        lock.release()


def test_a_node_lock_released_during_the_wait_lets_the_run_go_on(tmp_path: Path) -> None:
    job_local = tmp_path / "local" / "j"
    lock = _leader(job_local, 0)
    timer = threading.Timer(0.3, lock.release)        # the orphan ends meanwhile
    timer.start()
    try:
        wait_for_orphans("j", job_local, ME, grace=30)
    finally:
        timer.cancel()
        lock.release()
