"""The job lock (ftkit.jobdir.lock): a second holder is refused with the holder named, a dead
holder never blocks, a predecessor's lock is taken over. Holders are real child processes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ftkit.errors import ConfigError, JobLockedError
from ftkit.jobdir import lock as joblock
from ftkit.jobdir.lock import JobLock, held_by, holder_record, predecessor

HOLD = """
import json, sys
from pathlib import Path
from ftkit.jobdir.lock import JobLock
lock = JobLock(Path(sys.argv[1]), "j")
lock.acquire(json.loads(sys.argv[2]), what="test")
print("locked", flush=True)
sys.stdin.read()
"""


class Holder:
    """A child process holding the lock at ``path`` as ``record`` until stopped."""

    def __init__(self, path: Path, record: dict[str, object]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), json.dumps(record)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "locked"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()


def _contend(path: Path, record: dict[str, object]) -> subprocess.CompletedProcess[str]:
    """Another process tries to take the lock (and gives it back at once)."""
    return subprocess.run([sys.executable, "-c", HOLD, str(path), json.dumps(record)],
                          input="", capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for h in made:
        h.stop()


def _rec(role: str = "rank 0", **kw: object) -> dict[str, object]:
    return {**holder_record(role, env={}), **kw}


def test_second_holder_refused_naming_the_holder(tmp_path: Path, holders: list[Holder]) -> None:
    path = tmp_path / "LOCK"
    holders.append(Holder(path, _rec("ftkit run", pid=4242, host="n1", launch="L1")))
    with pytest.raises(JobLockedError) as err:
        JobLock(path, "j").acquire(_rec(launch="L2"), what="the job's PFS directory")
    msg = str(err.value)
    assert "job j is already running" in msg and "ftkit run pid 4242 on host n1" in msg
    assert str(path) in msg and "another FTKIT_JOB" in msg
    assert isinstance(err.value, ConfigError)       # ftkit run does not retry it
    assert held_by(path)["launch"] == "L1"


def test_a_lock_this_process_holds_is_not_named_as_another_run(tmp_path: Path) -> None:
    path = tmp_path / "LOCK"
    first = JobLock(path, "j")
    first.acquire(holder_record("node leader of node 0", env={}), what="node 0's directory")
    try:
        with pytest.raises(JobLockedError) as err:
            JobLock(path, "j").acquire(holder_record("node leader of node 0", env={}),
                                       what="node 0's directory")
    finally:
        first.release()
    msg = str(err.value)
    assert "held by this very process" in msg and f"pid {os.getpid()}" in msg
    assert "not closed" in msg and "already running" not in msg


def test_dead_holder_never_blocks(tmp_path: Path, holders: list[Holder]) -> None:
    path = tmp_path / "LOCK"
    holder = Holder(path, _rec(launch="L1"))
    holders.append(holder)
    holder.kill()
    assert held_by(path) is None
    lock = JobLock(path, "j")
    lock.acquire(_rec(launch="L2"), what="x")
    assert lock.held and json.loads(path.read_text())["launch"] == "L2"
    lock.release()
    assert not lock.held and path.exists()


FORKING = """
import json, os, sys, time
from pathlib import Path
from ftkit.jobdir.lock import JobLock, holder_record
lock = JobLock(Path(sys.argv[1]), "j")
lock.acquire(holder_record("node leader of node 1", env={}), what="test")
if os.fork() == 0:               # a data loader worker: shares the open file, and the flock
    time.sleep(120)
    os._exit(0)
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_dead_holders_lock_kept_by_its_forked_children_is_taken_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A killed node leader's forked loader workers keep the open file, and with it the
    flock, for seconds: its successor on this host takes the lock over at once (the holder
    pid is dead) instead of refusing as if the job ran twice."""
    path = tmp_path / "LOCK"
    proc = subprocess.Popen([sys.executable, "-c", FORKING, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert held_by(path) is not None                  # the child keeps it
        lock = JobLock(path, "j")
        lock.acquire(_rec("node leader of node 1", launch="L2"), what="node 1's directory")
        assert lock.held and "took over" in caplog.text and "has ended" in caplog.text
        assert json.loads(path.read_text())["launch"] == "L2"
        lock.release()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)


def test_requeued_slurm_job_takes_over_at_once(tmp_path: Path, holders: list[Holder],
                                               caplog: pytest.LogCaptureFixture) -> None:
    """A lock of the same Slurm job at an earlier restart count (on a network file system a
    dead node's lock can outlive it) is replaced by a new lock file; any other contender is
    then refused by the new holder."""
    path = tmp_path / "LOCK"
    holders.append(Holder(path, _rec(slurm_job="77", slurm_restart=0, launch="L1")))
    inode = path.stat().st_ino
    lock = JobLock(path, "j")
    lock.acquire(_rec(slurm_job="77", slurm_restart=1, launch="L2"), what="x")
    assert path.stat().st_ino != inode and "took over" in caplog.text
    assert json.loads(path.read_text())["slurm_restart"] == 1
    other = _contend(path, _rec(slurm_job="78", launch="L3"))
    assert other.returncode != 0 and "JobLockedError: job j is already running" in \
        other.stderr, other.stderr
    lock.release()
    assert _contend(path, _rec(slurm_job="78", launch="L3")).returncode == 0


def test_earlier_attempt_of_the_same_run_is_taken_over_after_the_grace(
        tmp_path: Path, holders: list[Holder], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(joblock, "TAKEOVER_GRACE", 0.3)
    path = tmp_path / "LOCK"
    holders.append(Holder(path, _rec(launch="L1", attempt=0)))
    lock = JobLock(path, "j")
    lock.acquire(_rec(launch="L1", attempt=1), what="x")
    assert json.loads(path.read_text())["attempt"] == 1
    lock.release()


def test_later_attempt_or_other_run_is_not_a_predecessor() -> None:
    me = {"launch": "L1", "attempt": 1, "slurm_job": "7", "slurm_restart": 1}
    assert predecessor({"launch": "L1", "attempt": 0}, me)[0] == "attempt"
    assert predecessor({"slurm_job": "7", "slurm_restart": 0}, me)[0] == "slurm"
    assert predecessor({"launch": "L1", "attempt": 1}, me) is None
    assert predecessor({"launch": "L2", "attempt": 0}, me) is None
    assert predecessor({"slurm_job": "7", "slurm_restart": 1}, me) is None
    assert predecessor({"slurm_job": "8", "slurm_restart": 0}, me) is None
    assert predecessor({}, {"launch": "", "attempt": 3}) is None


def test_lock_file_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    bait = tmp_path / "bait"
    bait.write_text("keep")
    (tmp_path / "LOCK").symlink_to(bait)
    with pytest.raises(JobLockedError, match="symbolic link"):
        JobLock(tmp_path / "LOCK", "j").acquire(_rec(), what="x")
    assert bait.read_text() == "keep"


def test_holder_record_from_the_environment() -> None:
    rec = holder_record("node leader of node 1", env={
        "FTKIT_LAUNCH_ID": "j-1", "FTKIT_ATTEMPT": "2", "SLURM_JOB_ID": "9",
        "SLURM_RESTART_COUNT": "1"})
    assert rec["pid"] == os.getpid() and rec["role"] == "node leader of node 1"
    assert (rec["launch"], rec["attempt"], rec["slurm_job"], rec["slurm_restart"]) == \
        ("j-1", 2, "9", 1)
