"""PFS retention (``FTKIT_PFS_KEEP``): which committed steps a flush retires, and the
background removal of their files.

Retiring a step has two parts of very different cost. Its ``COMMITTED`` record is removed
durably right after the newer step's commit, inside the flush (:func:`retract_steps`: an
unlink and a directory fsync), so from then on the step is incomplete for every reader.
Its files — the whole state's bytes — are deleted by a :class:`Reaper` thread on rank 0
behind the training: on a file system that discards freed blocks, or a parallel file system
with many objects, that delete took as long as a third of the flush. A crash before the
files are gone leaves an incomplete step directory, which the next flush removes (as after
any crash). The next flush waits for the reaper before it starts (its clean-up of
incomplete directories never races it), and so do ``Checkpointer.wait`` and ``close`` (a
finished job leaves only the kept steps).
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import shutil
import threading
from pathlib import Path

from ftkit.fs import fsync_dir
from ftkit.storage.pfs import hdf5
from ftkit.storage.stepnames import step_dirs, step_name

log = logging.getLogger("ftkit.storage.pfs.level")    # where retention logged before it moved


def retract_steps(job_dir: Path, newest: int, keep: int) -> list[int]:
    """Rank 0, right after PFS step ``newest`` was committed: durably remove the COMMITTED
    record of every committed step older than the ``keep`` newest ones up to ``newest``.
    Steps numbered above ``newest`` are left alone: they belong to a timeline a restore
    abandoned and are retracted when their number is flushed again. A record that cannot be
    removed is logged and its step stays committed. Local; returns the steps no longer
    committed, oldest first (their files are :func:`remove_files`' business)."""
    committed = sorted((s for s, d in step_dirs(job_dir)
                        if s <= newest and (d / hdf5.COMMITTED).is_file()), reverse=True)
    gone = []
    for step in sorted(committed[keep:]):
        try:
            hdf5.retract_commit(job_dir / step_name(step))
        except OSError as exc:
            log.warning("could not remove PFS step %d (FTKIT_PFS_KEEP=%d): %s; it stays "
                        "committed", step, keep, exc)
            continue
        gone.append(step)
    return gone


def remove_files(job_dir: Path, steps: list[int]) -> None:
    """Delete the directories of retracted ``steps``. Failures are logged, never raised:
    what is left is an incomplete step, which the next flush removes. Local."""
    for step in steps:
        try:
            shutil.rmtree(job_dir / step_name(step))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("removing PFS step %d: %s; it is no longer committed, the next "
                        "flush removes what is left", step, exc)
    if steps:
        try:
            fsync_dir(job_dir)
        except OSError as exc:
            log.warning("fsync of %s after removing PFS steps %s: %s", job_dir, steps, exc)


class Reaper:
    """Rank 0's background deleter of retired steps' files (one thread, started on first
    use, in submission order). Local; the flush thread submits, the flush thread and the
    training thread (``Checkpointer.wait``) wait."""

    def __init__(self) -> None:
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pending: list[cf.Future[None]] = []
        self._lock = threading.Lock()

    def remove(self, job_dir: Path, steps: list[int]) -> None:
        """Delete the directories of retracted ``steps`` behind the caller."""
        if not steps:
            return
        with self._lock:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="ftkit-pfs-reaper")
            self._pending.append(self._pool.submit(remove_files, job_dir, list(steps)))

    def wait(self) -> None:
        """Block until every removal submitted so far has finished."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.result()           # remove_files logs its failures, never raises

    def close(self) -> None:
        """Finish every removal and stop the thread."""
        self.wait()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def remove_steps(job_dir: Path) -> list[int]:
    """Delete every PFS step under ``job_dir`` (an explicit fresh start; the event log and
    the run record stay). Each step's COMMITTED record goes first, durably, so a crash midway
    leaves incomplete steps only. Returns the steps removed. Local; rank 0 only."""
    if not job_dir.is_dir():
        return []
    found = step_dirs(job_dir)
    for _, path in found:
        hdf5.retract_commit(path)
        shutil.rmtree(path, ignore_errors=True)
    fsync_dir(job_dir)
    return [step for step, _ in found]

