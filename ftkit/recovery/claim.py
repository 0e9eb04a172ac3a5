"""A run's claim on its job's directories: the one-writer locks, the run identity, and what
a successful end gives back.

A :class:`~ftkit.Checkpointer` claims its job when it is built (every node leader locks its
node's local directory, rank 0 the job's PFS directory unless ``ftkit run`` holds that lock;
see :mod:`ftkit.jobdir.lock`) and releases the claim in ``close()``. When ``ftkit run`` asks for it
(``FTKIT_TIDY_LOCAL=1``, unless ``--keep-local``) and the job ended well with its newest
committed step on the PFS, every node leader removes its node's local directory on release:
a finished job leaves no copies in node memory. Nothing is lost: a later ``--resume``
restores that step from the PFS.

Removal order keeps "one job, one writer" intact: everything but the lock file first, then
the lock file (still held), then the lock is given back, then the empty directories. A
second instance that was waiting for the lock finds a new lock file and a clean tree; one
that got the lock first keeps what it created (a directory that is not empty stays).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from ftkit.comm.dist import DistComm, describe
from ftkit.comm.topology import Topology
from ftkit.config import Config
from ftkit.errors import ConfigError, JobLockedError
from ftkit.jobdir import identity
from ftkit.jobdir.lock import LOCK_FILE, JobLock, holder_record
from ftkit.storage.private import remove_entry

log = logging.getLogger(__name__)

class JobClaim:
    """What this rank holds of its job: lock files (node leaders, and rank 0 without
    ``ftkit run``) and, once :meth:`take` returned, the run identity ``run_id``."""

    def __init__(self, config: Config, topo: Topology, dc: DistComm, node_root: Path) -> None:
        self.config, self.topo, self.dc, self.node_root = config, topo, dc, node_root
        self._locks: list[JobLock] = []
        self.run_id = ""

    def take(self) -> str:
        """Lock the job's directories, then agree on the run identity; returns it. Raises
        JobLockedError (another instance holds a lock) or ConfigError (no identity can be
        recorded) on every rank. All ranks call."""
        self._lock_all()
        self.run_id = self._agree_run_id()
        return self.run_id

    def _lock_all(self) -> None:
        failure = None
        try:
            if self.topo.is_node_leader:
                self._lock(self.node_root / LOCK_FILE, f"node {self.topo.node}'s local "
                           f"directory", f"node leader of node {self.topo.node}")
            if self.topo.rank == 0 and not os.environ.get(identity.LAUNCH_ID_ENV):
                self._lock_pfs()
        except (JobLockedError, OSError) as exc:
            failure = str(exc)
        failures = self.dc.agree(failure, "prepare", -1)
        if failures:
            self.release()
            first = min(failures)
            raise JobLockedError(f"rank {first}: {failures[first]}" + (
                f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""))

    def _lock_pfs(self) -> None:
        """Rank 0 without ``ftkit run``: a PFS that cannot be locked is only a warning."""
        try:
            self.config.job_pfs_dir.mkdir(parents=True, exist_ok=True)
            self._lock(self.config.job_pfs_dir / LOCK_FILE, "the job's PFS directory", "rank 0")
        except OSError as exc:
            log.warning("cannot lock %s: %s", self.config.job_pfs_dir, exc)

    def _lock(self, path: Path, what: str, role: str) -> None:
        lock = JobLock(path, self.config.job)
        lock.acquire(holder_record(role), what=what)
        self._locks.append(lock)

    def _agree_run_id(self) -> str:
        """Rank 0 reads or makes the run identity (:mod:`ftkit.jobdir.identity`), every
        rank receives it; ConfigError everywhere when it cannot. All ranks call."""
        got: dict[str, str] = {}
        if self.topo.rank == 0:
            try:
                got["run"] = identity.run_id(
                    self.config.job_pfs_dir, self.config.job,
                    fresh=self.config.start == "fresh",
                    candidate=os.environ.get(identity.LAUNCH_ID_ENV) or None)
            except (OSError, ValueError) as exc:
                got["error"] = (f"cannot read or record the run identity under "
                                f"{self.config.job_pfs_dir}: {describe(exc)}")
        got = self.dc.bcast(got, "prepare")
        if "error" in got:
            raise ConfigError(got["error"])
        return got["run"]

    def release(self, *, tidy: bool = False) -> None:
        """Give the locks back; with ``tidy`` a node leader first removes its node's local
        directory (module doc for the order). Local; never raises."""
        remove = tidy and self.topo.is_node_leader and _removable(self.node_root)
        if remove:
            _remove_contents(self.node_root)
        for lock in self._locks:
            lock.release()
        self._locks.clear()
        if remove:
            _remove_empty_dirs(self.node_root, Path(self.config.local_dir))


def remove_moved_node(config: Config, node_root: Path) -> None:
    """In-job recovery moved this node's ranks to another host: remove what they left in
    ``node_root`` on this one (nobody reads it again; the slots of a relaunch follow the
    move). One process of the moved node on this host calls; local; never raises."""
    if _removable(node_root):
        _remove_contents(node_root)
        _remove_empty_dirs(node_root, Path(config.local_dir))


def _removable(node_root: Path) -> bool:
    return node_root.is_dir() and not node_root.is_symlink()


def _remove_contents(node_root: Path) -> None:
    """Every entry of ``node_root``, the lock file last. Local; a warning on failure."""
    try:
        for entry in sorted(os.listdir(node_root)):
            if entry != LOCK_FILE:
                remove_entry(node_root / entry)
        remove_entry(node_root / LOCK_FILE)
    except OSError as exc:
        log.warning("cannot remove the node-local copies in %s: %s", node_root, exc)


def _remove_empty_dirs(node_root: Path, top: Path) -> None:
    """``node_root`` and its empty parents up to (not including) ``top`` (FTKIT_LOCAL_DIR)."""
    path = node_root
    while path != top and top in path.parents:
        try:
            path.rmdir()
        except OSError:
            return              # not empty (another node's or a new instance's), or gone
        path = path.parent
