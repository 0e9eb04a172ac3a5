"""One job, one writer: the job lock.

Two instances of one job (the same ``FTKIT_JOB`` and directories) at once delete each other's
steps and resume each other's state. So every place a job writes is guarded by a lock file:

* ``$FTKIT_PFS_DIR/<job>/LOCK`` — held by ``ftkit run`` for its whole life (all attempts and
  relaunches); by rank 0 of a job started without ``ftkit run``;
* ``<node-local job dir>/node-<id>/LOCK`` — held by each node leader while its
  :class:`~ftkit.Checkpointer` lives (two runs in different working directories share the
  node-local tree).

The lock is ``flock`` on the file (it belongs to the open file, so no other open or close of
the file in the holder's process drops it, as one would a POSIX record lock; Linux maps it to
byte-range locks on NFS, Lustre needs its ``flock`` mount option): the kernel releases it when
the holder dies, so a dead holder never blocks. After locking, the holder writes who it is
(host, pid, role, launch id, attempt, Slurm job and restart count) into the file; a refused
contender names that holder.

A lock still held by a *predecessor* of the contender is taken over by replacing the file (a
new inode; the old holder keeps a lock on an unlinked file): a Slurm job requeued under the
same job id (Slurm runs one instance of a job id at a time; on a network file system the
dead node's lock may outlive it), or an earlier attempt of the same ``ftkit run``, which killed
it (given :data:`TAKEOVER_GRACE` seconds to finish dying first). So is a lock whose holder
process on this host has ended while processes it forked live on (a killed rank's data
loader workers hold the open file, and with it the ``flock``, for seconds): the holder's
pid is not alive (a pid reused since is taken as alive: refused, never two writers). A file system without
locking support (``ENOLCK``, ``EOPNOTSUPP``, ``ENOSYS``) gets a warning, not a refusal.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ftkit.errors import JobLockedError
from ftkit.jobdir import paths

log = logging.getLogger(__name__)

LOCK_FILE = paths.LOCK
TAKEOVER_GRACE = 30.0          # seconds an earlier attempt of the same ftkit run may take to die
_POLL = 0.1
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def holder_record(role: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Who takes the lock: this process, ``role`` (``ftkit run``, ``rank 0``,
    ``node leader of node 1``), its launch, attempt and Slurm job."""
    env = os.environ if env is None else env
    return {"host": socket.gethostname(), "pid": os.getpid(), "role": role,
            "launch": env.get("FTKIT_LAUNCH_ID", ""), "attempt": _int(env.get("FTKIT_ATTEMPT")),
            "slurm_job": env.get("SLURM_JOB_ID", ""),
            "slurm_restart": _int(env.get("SLURM_RESTART_COUNT")), "since": time.time()}


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


def predecessor(holder: Mapping[str, Any], me: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(kind, why)`` when ``holder`` is a predecessor of ``me`` whose lock may be taken
    over — kind ``slurm`` (a requeued job: at once) or ``attempt`` (an earlier attempt of
    the same ``ftkit run``, which killed it: after :data:`TAKEOVER_GRACE`) — else None
    (pure)."""
    if me.get("slurm_job") and holder.get("slurm_job") == me["slurm_job"] \
            and _num(holder.get("slurm_restart")) < _num(me.get("slurm_restart")):
        return "slurm", (f"Slurm requeued job {me['slurm_job']} (restart "
                         f"{me['slurm_restart']}); the lock was its restart "
                         f"{holder.get('slurm_restart')}'s")
    if me.get("launch") and holder.get("launch") == me["launch"] \
            and _num(holder.get("attempt")) < _num(me.get("attempt")):
        return "attempt", (f"attempt {holder.get('attempt')} of this ftkit run held it and "
                           f"was stopped by it")
    return None


def may_take_over(holder: Mapping[str, Any], me: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(kind, why)`` when ``me`` may take the lock ``holder`` holds: a predecessor
    (:func:`predecessor`), or kind ``dead`` — a holder process on this host that has ended
    while processes it forked (a data loader's workers) keep the lock alive: a ``flock``
    belongs to the open file, which a fork shares. Local (looks at the process table)."""
    found = predecessor(holder, me)
    if found is not None:
        return found
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int) \
            and pid != os.getpid() and not _alive(pid):
        return "dead", (f"its holder, pid {pid} on this host, has ended; processes it "
                        f"forked still held the file open")
    return None


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` in ``/proc/<pid>/stat`` (``R``, ``S``, ``Z`` for
    a zombie nobody reaped yet, ...), or None when it cannot be read (no such process, no
    ``/proc``). Local, read-only."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie; when in doubt, alive (local)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return process_state(pid) not in ("Z", "X")


def _num(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def describe(holder: Mapping[str, Any] | None) -> str:
    """``ftkit run pid 12 on host n1 since 2026-12-02 01:50:00 (attempt 0)`` (pure)."""
    if not holder:
        return "a process that has not said who it is (it may be starting)"
    since = holder.get("since")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) \
        if isinstance(since, (int, float)) else ""
    extra = [f"attempt {holder['attempt']}" if holder.get("attempt") else "",
             f"Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else ""]
    tail = ", ".join(x for x in extra if x)
    return (f"{holder.get('role', '?')} pid {holder.get('pid', '?')} on host "
            f"{holder.get('host', '?')}{when}" + (f" ({tail})" if tail else ""))


class JobLock:
    """The lock file ``path`` of job ``job``. Local (no MPI); one instance per holder."""

    def __init__(self, path: Path, job: str) -> None:
        self.path, self.job = path, job
        self.fd: int | None = None

    def acquire(self, record: Mapping[str, Any], *, what: str) -> None:
        """Take the lock for ``record`` (:func:`holder_record`), or raise JobLockedError
        naming the job, ``what`` the lock guards, the holder and what to do. Takes over a
        predecessor's lock (module doc); without locking support on the file system, warns
        and returns without a lock."""
        deadline: float | None = None
        while True:
            fd = self._open(self.path)
            if self._try_lock(fd):
                if self._same_file(fd):
                    self._own(fd, record)
                    return
                os.close(fd)                  # replaced under us: lock the new file
                continue
            holder = _read(fd)
            os.close(fd)
            found = may_take_over(holder or {}, record)
            if found is None:
                raise JobLockedError(self._refusal(holder, what))
            kind, why = found
            if kind == "attempt":
                deadline = deadline or time.monotonic() + TAKEOVER_GRACE
                if time.monotonic() < deadline:
                    time.sleep(_POLL)         # the killed attempt may still be exiting
                    continue
            self._take_over(record, why, holder)
            return

    def _open(self, path: Path) -> int:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise JobLockedError(f"job {self.job}: {path} is a symbolic link; ftkit's "
                                     f"lock file must be a regular file (remove it)") from exc
            raise

    def _try_lock(self, fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return False
            if exc.errno in _UNSUPPORTED:
                log.warning("the file system of %s cannot lock files (%s): a second instance "
                            "of job %s would not be refused", self.path, exc, self.job)
                self.fd = fd
                return True
            os.close(fd)
            raise
        return True

    def _same_file(self, fd: int) -> bool:
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        fst = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)

    def _own(self, fd: int, record: Mapping[str, Any]) -> None:
        """Locked: say who holds it (a full file system only loses the description)."""
        self.fd = fd
        data = json.dumps(dict(record)).encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        except OSError as exc:
            log.warning("cannot describe the holder in %s: %s", self.path, exc)

    def _take_over(self, record: Mapping[str, Any], why: str,
                   holder: Mapping[str, Any] | None) -> None:
        """Replace the lock file by a new, locked one (the old holder is known dead)."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        fd = self._open(tmp)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._own(fd, record)
        os.replace(tmp, self.path)
        log.warning("job %s: took over %s from %s: %s", self.job, self.path, describe(holder),
                    why)

    def _refusal(self, holder: Mapping[str, Any] | None, what: str) -> str:
        if holder is not None and _is_this_process(holder):
            return (f"job {self.job}: {self.path} ({what}) is held by this very process "
                    f"(pid {os.getpid()}, as {holder.get('role', '?')}): "
                    f"an earlier Checkpointer of this job in this process was not closed; "
                    f"call its close() (it gives the locks back even when it raises) before "
                    f"making another")
        return (f"job {self.job} is already running: {describe(holder)} holds {self.path} "
                f"({what}); two instances of one job would destroy each other's checkpoints. "
                f"Wait for it to end and launch again to resume it, or use another FTKIT_JOB")

    def release(self) -> None:
        """Give the lock back (local; idempotent). The file stays: removing it would let a
        contender that opened it lock an unlinked file."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    @property
    def held(self) -> bool:
        return self.fd is not None


def _is_this_process(holder: Mapping[str, Any]) -> bool:
    """Is ``holder`` (a lock file's description) this process on this host? Pure but for
    the process id and host name."""
    return holder.get("pid") == os.getpid() \
        and holder.get("host") == socket.gethostname()


def _read(fd: int) -> dict[str, Any] | None:
    """The holder's description in an open lock file, or None."""
    try:
        data = os.pread(fd, 64 << 10, 0)
        record = json.loads(data) if data else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def held_by(path: Path) -> dict[str, Any] | None:
    """The holder of the lock file ``path`` when it is held now, else None (local; a
    probe that takes and gives back the lock when it is free)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return _read(fd) or {}
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
