"""Node-local level: ``$FTKIT_LOCAL_DIR/<job>/node-<id>/step-<s>/rank-<r>.ftk``.

A rank's shard is written into one of its reused files under ``node-<id>/slots/`` and
published in its step directory as a hard link (:mod:`ftkit.storage.slots`).

A step directory without ``COMMITTED`` holds tentative shards; with it, permanent ones.
Retention: when the tentative version of step ``s`` is started, the node leader drops every
version older than the newest permanent one. So the level holds at most two versions at any
time (permanent + tentative while a checkpoint runs; newest + previous permanent between
checkpoints, which leaves a fallback if the newest turns out corrupted).

Directories are private (0700), shards 0600. A rank only ever touches its own node's directory.
``/dev/shm`` is shared with other users, so the whole tree, from the base directory
``FTKIT_LOCAL_DIR`` down, is entered only through real directories of this user with no
group/other permission bits, and never through a symbolic link (:mod:`ftkit.storage.private`).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ftkit.capture.flatten import TensorLeaf
from ftkit.comm.dist import DistComm, describe
from ftkit.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    StorageError,
)
from ftkit.faults import Faults
from ftkit.fs import fsync_dir, write_record
from ftkit.storage.level import Level
from ftkit.storage.private import (
    check_private_dir,
    create_missing_dirs,
    create_new,
    ensure_private_tree,
    problem,
    read_file,
    remove_entry,
)
from ftkit.storage.shard import Shard, write_shard
from ftkit.storage.slots import Reservation, Slots
from ftkit.storage.stepnames import PARKED, STEP, step_name, step_number

if TYPE_CHECKING:
    from ftkit.config import Config

log = logging.getLogger(__name__)
COMMITTED = "COMMITTED"


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) with mode 0700; tighten an existing one. For
    trees no other user can write to (the PFS steps); the node-local tree, which lives in
    a shared directory, uses :func:`ftkit.storage.private.ensure_private_tree`."""
    create_missing_dirs(path)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory")
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o700)


class LocalLevel(Level):
    """Node-local storage of one rank."""

    name = "local"

    def __init__(self, root: Path, *, rank: int, node_leader: bool, faults: Faults,
                 base: Path | None = None) -> None:
        """``root`` is this node's directory ``<base>[/<host>]/<job>/node-<id>``; ``base``
        is ``FTKIT_LOCAL_DIR`` (default: two levels above ``root``), the directory from
        which every directory down to a step is checked private (:meth:`for_config`)."""
        self.root = root            # .../<job>/node-<id>
        self.base = root.parent.parent if base is None else base
        self.rank = rank
        self.node_leader = node_leader
        self.faults = faults
        self.slots = Slots(root, rank)           # reused shard files (storage/slots.py)
        self._reserved: tuple[int, Reservation] | None = None
        self.node_ranks: set[int] | None = None  # ranks on this node (slots of others go)
        root.relative_to(self.base)             # ValueError: the tree must be below the base

    @classmethod
    def for_config(cls, config: Config, node: int, *, host: str | None = None, rank: int,
                   node_leader: bool, faults: Faults) -> LocalLevel:
        """The level of (virtual) node ``node`` (``host``: the Slurm node name, or None)
        below ``config.local_dir``, which is the base directory checked private."""
        return cls(config.node_dir(node, host), rank=rank, node_leader=node_leader,
                   faults=faults, base=Path(config.local_dir))

    def prepare(self) -> None:
        """Create the node directory and its parents (private), or check they are (an
        UnsafeLocalDirError, which is an OSError, when one is not), and check the node
        directory is writable. Local."""
        ensure_private_tree(self.base, self.root)
        probe = self.root / f".probe-rank-{self.rank}"
        probe.unlink(missing_ok=True)           # a crash's leftover; a link is not followed
        os.close(create_new(probe))
        probe.unlink()

    def prepare_everywhere(self, dc: DistComm) -> None:
        """:meth:`prepare` on every rank; the same ConfigError everywhere if any rank
        cannot. All ranks call."""
        failure = None
        try:
            self.prepare()
        except OSError as exc:
            failure = f"cannot use local directory {self.root}: {describe(exc)}"
        failures = dc.agree(failure, "prepare", -1)
        if failures:
            raise ConfigError("FTKIT_LOCAL_DIR is not usable: " + "; ".join(
                f"rank {r}: {f}" for r, f in sorted(failures.items())))

    # ---------------------------------------------------------------- paths
    def step_dir(self, step: int) -> Path:
        return self.root / step_name(step)

    def shard_path(self, step: int, rank: int | None = None) -> Path:
        return self.step_dir(step) / f"rank-{self.rank if rank is None else rank}.ftk"

    def ensure_step_dir(self, step: int) -> Path:
        """Create this node's directory of ``step`` and its parents, or check they are
        private (UnsafeLocalDirError, an OSError, when one is not)."""
        ensure_private_tree(self.base, self.step_dir(step))
        return self.step_dir(step)

    def _step_problem(self, step: int) -> str | None:
        """None when this node's directory of ``step`` is private; else ``"missing"`` or
        what is wrong with it (a symbolic link, another owner, open permissions)."""
        try:
            return problem(self.step_dir(step), directory=True)
        except FileNotFoundError:
            return "missing"

    def file_problem(self, path: Path) -> str | None:
        """None when ``path`` is a regular file in a private step directory of this node;
        else ``"missing"`` or what is wrong with the directory or the file (a symbolic link
        is never followed)."""
        try:
            for entry, directory in ((path.parent, True), (path, False)):
                why = problem(entry, directory=directory)
                if why is not None:
                    return f"{entry} {why}; ftkit does not use it"
        except FileNotFoundError:
            return "missing"
        return None

    def steps(self) -> list[int]:
        """Steps with a directory on this node, ascending."""
        return self._numbered(STEP)

    def _numbered(self, prefix: str) -> list[int]:
        """The steps of this node's entries named ``<prefix><s>`` (:mod:`.stepnames`),
        ascending."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(s for n in names if (s := step_number(n, prefix)) is not None)

    # -------------------------------------------------------------- protocol
    def reserve(self, step: int, meta: dict[str, Any], tree: Any,
                leaves: list[TensorLeaf]) -> Reservation | None:
        """A free slot laid out for this rank's shard of ``step``, for the capture to copy
        tensors straight into (``Stager.start(into=...)``); :meth:`write_tentative` of the
        same step and ``meta`` finishes it. None when no slot can be had now (the write
        then tries again and reports any error). Local."""
        self._reserved = None
        try:
            res = self.slots.reserve(meta, tree, leaves)
        except OSError as exc:
            log.warning("rank %d: no slot for step %d (%s); staging in memory", self.rank,
                        step, exc)
            return None
        self._reserved = None if res is None else (step, res)
        return res

    def write_tentative(self, step: int, meta: dict[str, Any], tree: Any,
                        leaves: list[TensorLeaf], buffers: list[np.ndarray]) -> None:
        path = self.shard_path(step)
        reserved, self._reserved = self._reserved, None
        if self.is_committed(step):
            raise CheckpointError(step, {}, message=(
                f"{self.step_dir(step)} already holds committed step {step} (rank "
                f"{self.rank}); steps must increase, so it is kept and not overwritten"))
        try:
            self.ensure_step_dir(step)
            if reserved is not None and reserved[0] == step and reserved[1].meta is meta:
                self.slots.finish(reserved[1], path, buffers)
            elif not self.slots.write(path, meta, tree, leaves, buffers):
                write_shard(path, meta, tree, leaves, buffers)
        except OSError as exc:
            raise StorageError(str(path), exc, rank=self.rank, step=step, level=self.name) \
                from exc
        finally:
            if reserved is not None:
                reserved[1].drop()      # a tensor that has not landed now never will
        self.faults.after_write(path, level=self.name, step=step)

    def close(self) -> None:
        """Unmap this rank's slots (their files stay for the next run). Local."""
        self.slots.close()

    def record_commit(self, step: int, record: dict[str, Any]) -> None:
        """Coordinator: durably record the decision. If any part fails (even the directory
        fsync after the rename), no record survives: the caller then aborts the step."""
        path = self.step_dir(step) / COMMITTED
        check_private_dir(self.step_dir(step))   # never unlink through a planted link
        try:
            write_record(path, record)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    def commit(self, step: int, record: dict[str, Any]) -> None:
        if self.node_leader and not self.is_committed(step):
            self.ensure_step_dir(step)
            write_record(self.step_dir(step) / COMMITTED, record)

    def discard(self, step: int) -> None:
        if self._step_problem(step) is None and not self.is_committed(step):
            self.shard_path(step).unlink(missing_ok=True)   # never a permanent version

    def record_info(self, step: int) -> dict[str, Any]:
        """``{"w": world size, "levels": [...], "run": run id, "nodes": rank -> node,
        "layout": {"dp", "tp", "pp"}}`` from the node's commit record of ``step`` (``w`` None
        when absent or unreadable; ``run``, ``nodes`` and ``layout`` None when the record
        does not say)."""
        path = self.step_dir(step) / COMMITTED
        try:
            rec = json.loads(read_file(path)) if self.file_problem(path) is None else {}
            nodes, layout = rec.get("nodes"), rec.get("layout")
            return {"w": int(rec["world"]), "levels": [str(x) for x in rec.get("levels",
                                                                             ["local"])],
                    "run": None if rec.get("run") is None else str(rec["run"]),
                    "nodes": None if nodes is None else [int(n) for n in nodes],
                    "layout": None if layout is None else
                    {k: int(layout[k]) for k in ("dp", "tp", "pp")}}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {"w": None, "levels": [], "run": None, "nodes": None, "layout": None}

    def record_world(self, step: int) -> int | None:
        """World size in the node's commit record of ``step`` (None if absent/unreadable)."""
        return self.record_info(step)["w"]

    def is_committed(self, step: int) -> bool:
        """A regular ``COMMITTED`` file in this node's private directory of ``step``."""
        return self.file_problem(self.step_dir(step) / COMMITTED) is None

    def release(self, keep: set[int]) -> None:
        """Every rank, right before it writes a step: unlink its own shard of every step
        not in ``keep`` (the steps :meth:`retain` is about to remove on the node leader),
        so its slot is free for this write whichever rank runs first. Not during a restore:
        the leader parks steps there, which must keep every file. Local."""
        for step in self.steps():
            if step not in keep and self._step_problem(step) is None:
                remove_entry(self.shard_path(step))

    def retain(self, keep: set[int], *, superseded_by: int | None = None) -> None:
        """Node leader: remove every step directory not in ``keep``, every parked step not
        newer than ``superseded_by`` (a committed step that replaces it), and the free slots
        of ranks not on this node (``node_ranks``, when set). Local."""
        if not self.node_leader:
            return
        for step in self.steps():
            if step not in keep:
                remove_entry(self.step_dir(step))
        if superseded_by is not None:
            for step in self.parked():
                if step <= superseded_by:
                    remove_entry(self.parked_dir(step))
        if self.node_ranks is not None:
            self.slots.prune(self.node_ranks)

    def remove_all(self) -> list[int]:
        """Node leader: delete every step of this node, parked ones included (an explicit
        fresh start). Returns the steps removed. Local."""
        steps, parked = self.steps(), self.parked()
        for path in [self.step_dir(s) for s in steps] + [self.parked_dir(s) for s in parked]:
            remove_entry(path)
        return sorted(set(steps) | set(parked))

    # -------------------------------------------------------------- parking
    def parked_dir(self, step: int) -> Path:
        return self.root / step_name(step, PARKED)

    def parked(self) -> list[int]:
        """Steps parked on this node (committed, not used by the last restore), ascending."""
        return self._numbered(PARKED)

    def park(self, steps: set[int]) -> None:
        """Node leader: move committed ``steps`` that a restore did not use out of the way
        (``step-<s>`` -> ``parked-step-<s>``, durable rename), so the job can commit those
        step numbers again; they are removed only once a newer committed step supersedes
        them (:meth:`retain`). Uncommitted versions of ``steps`` are removed. Local."""
        if not self.node_leader:
            return
        for step in sorted(steps & set(self.steps())):
            if not self.is_committed(step):
                remove_entry(self.step_dir(step))
                continue
            remove_entry(self.parked_dir(step))
            os.replace(self.step_dir(step), self.parked_dir(step))
            log.warning("%s: committed step %d was not used by the restore; parked as %s "
                        "until a newer committed step supersedes it", self.root, step,
                        self.parked_dir(step).name)
        fsync_dir(self.root)

    # --------------------------------------------------------------- restore
    def inventory(self) -> dict[int, dict[str, Any]]:
        """``{step: {"committed": bool, "have": bool}}`` of the steps on this node; a step
        whose directory is not private (a planted link) is neither (logged)."""
        found = {}
        for s in self.steps():
            why = self._step_problem(s)
            if why is not None:
                log.warning("%s (rank %d, step %d) %s; ftkit does not use it",
                            self.step_dir(s), self.rank, s, why)
            found[s] = {"committed": self.is_committed(s),
                        "have": self.file_problem(self.shard_path(s)) is None}
        return found

    def _existing(self, step: int) -> Path:
        path = self.shard_path(step)
        why = self.file_problem(path)
        if why is not None:
            raise CorruptCheckpointError(str(path), "shard is missing" if why == "missing"
                                         else why, rank=self.rank, step=step, level=self.name)
        return path

    def check_shard(self, step: int, world: int, *, data: bool = True) -> None:
        """Verify this rank's shard of ``step`` (CorruptCheckpointError): its header, and
        with ``data`` every tensor's checksum (:meth:`Shard.check`). Local."""
        Shard.check(self._existing(step), rank=self.rank, step=step, world=world,
                    level=self.name, data=data)

    def open_shard(self, step: int) -> Shard:
        return Shard.open(self._existing(step), rank=self.rank, step=step, level=self.name)
