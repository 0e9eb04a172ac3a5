"""Node-local level: ``$FTKIT_LOCAL_DIR/<job>/node-<id>/step-<s>/rank-<r>.ftk``.

A step directory without ``COMMITTED`` holds tentative shards; with it, permanent ones.
Retention: when the tentative version of step ``s`` is started, the node leader drops every
version older than the newest permanent one. So the level holds at most two versions at any
time (permanent + tentative while a checkpoint runs; newest + previous permanent between
checkpoints, which leaves a fallback if the newest turns out corrupted).

Directories are private (0700), shards 0600. A rank only ever touches its own node's directory.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from ftkit.capture.flatten import TensorLeaf
from ftkit.errors import CheckpointError, CorruptCheckpointError, StorageError
from ftkit.storage.level import Level
from ftkit.storage.shard import Shard, fsync_dir, write_atomic, write_shard
from ftkit.testing.faults import Faults

log = logging.getLogger(__name__)
_STEP_RE = re.compile(r"^step-(\d+)$")
_PARKED_RE = re.compile(r"^parked-step-(\d+)$")
COMMITTED = "COMMITTED"


def make_private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) with mode 0700; tighten an existing one."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            continue
        fsync_dir(d.parent)          # the new entry survives a crash of the node
    if not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory")
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o700)


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Durably write a small JSON record (temp file, fsync, rename, fsync dir)."""
    write_atomic(path, [json.dumps(record).encode()])


class LocalLevel(Level):
    """Node-local storage of one rank."""

    name = "local"

    def __init__(self, root: Path, *, rank: int, node_leader: bool, faults: Faults) -> None:
        self.root = root            # .../<job>/node-<id>
        self.rank = rank
        self.node_leader = node_leader
        self.faults = faults

    def prepare(self) -> None:
        """Create the node directory (private) and check it is writable. Local."""
        make_private_dir(self.root)
        probe = self.root / f".probe-rank-{self.rank}"
        probe.write_bytes(b"")
        probe.unlink()

    # ---------------------------------------------------------------- paths
    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def shard_path(self, step: int, rank: int | None = None) -> Path:
        return self.step_dir(step) / f"rank-{self.rank if rank is None else rank}.ftk"

    def ensure_step_dir(self, step: int) -> Path:
        make_private_dir(self.step_dir(step))
        return self.step_dir(step)

    def steps(self) -> list[int]:
        """Steps with a directory on this node, ascending."""
        return self._numbered(_STEP_RE)

    def _numbered(self, pattern: re.Pattern[str]) -> list[int]:
        """The numbers of this node's entries whose name matches ``pattern``, ascending."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := pattern.match(n)))

    # -------------------------------------------------------------- protocol
    def write_tentative(self, step: int, meta: dict[str, Any], tree: Any,
                        leaves: list[TensorLeaf], buffers: list[np.ndarray]) -> None:
        path = self.shard_path(step)
        if self.is_committed(step):
            raise CheckpointError(step, {}, message=(
                f"{self.step_dir(step)} already holds committed step {step} (rank "
                f"{self.rank}); steps must increase, so it is kept and not overwritten"))
        try:
            make_private_dir(self.step_dir(step))
            write_shard(path, meta, tree, leaves, buffers)
        except OSError as exc:
            raise StorageError(str(path), exc, rank=self.rank, step=step, level=self.name) \
                from exc
        self.faults.after_write(path, level=self.name, step=step)

    def record_commit(self, step: int, record: dict[str, Any]) -> None:
        """Coordinator: durably record the decision. If any part fails (even the directory
        fsync after the rename), no record survives: the caller then aborts the step."""
        path = self.step_dir(step) / COMMITTED
        try:
            write_record(path, record)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    def commit(self, step: int, record: dict[str, Any]) -> None:
        if self.node_leader and not (self.step_dir(step) / COMMITTED).exists():
            make_private_dir(self.step_dir(step))
            write_record(self.step_dir(step) / COMMITTED, record)

    def discard(self, step: int) -> None:
        if not self.is_committed(step):      # never touch a permanent version
            self.shard_path(step).unlink(missing_ok=True)

    def record_info(self, step: int) -> dict[str, Any]:
        """``{"w": world size, "levels": [...], "run": run id, "nodes": rank -> node}`` from
        the node's commit record of ``step`` (``w`` None when absent or unreadable; ``run``
        and ``nodes`` None when the record does not say)."""
        try:
            rec = json.loads((self.step_dir(step) / COMMITTED).read_text())
            nodes = rec.get("nodes")
            return {"w": int(rec["world"]), "levels": [str(x) for x in rec.get("levels",
                                                                             ["local"])],
                    "run": None if rec.get("run") is None else str(rec["run"]),
                    "nodes": None if nodes is None else [int(n) for n in nodes]}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {"w": None, "levels": [], "run": None, "nodes": None}

    def record_world(self, step: int) -> int | None:
        """World size in the node's commit record of ``step`` (None if absent/unreadable)."""
        return self.record_info(step)["w"]

    def is_committed(self, step: int) -> bool:
        return (self.step_dir(step) / COMMITTED).is_file()

    def retain(self, keep: set[int], *, superseded_by: int | None = None) -> None:
        """Node leader: remove every step directory not in ``keep``, and every parked step
        not newer than ``superseded_by`` (a committed step that replaces it). Local."""
        if not self.node_leader:
            return
        for step in self.steps():
            if step not in keep:
                shutil.rmtree(self.step_dir(step), ignore_errors=True)
        if superseded_by is not None:
            for step in self.parked():
                if step <= superseded_by:
                    shutil.rmtree(self.parked_dir(step), ignore_errors=True)

    def remove_all(self) -> list[int]:
        """Node leader: delete every step of this node, parked ones included (an explicit
        fresh start). Returns the steps removed. Local."""
        steps, parked = self.steps(), self.parked()
        for path in [self.step_dir(s) for s in steps] + [self.parked_dir(s) for s in parked]:
            shutil.rmtree(path, ignore_errors=True)
        return sorted(set(steps) | set(parked))

    # -------------------------------------------------------------- parking
    def parked_dir(self, step: int) -> Path:
        return self.root / f"parked-step-{step}"

    def parked(self) -> list[int]:
        """Steps parked on this node (committed, not used by the last restore), ascending."""
        return self._numbered(_PARKED_RE)

    def park(self, steps: set[int]) -> None:
        """Node leader: move committed ``steps`` that a restore did not use out of the way
        (``step-<s>`` -> ``parked-step-<s>``, durable rename), so the job can commit those
        step numbers again; they are removed only once a newer committed step supersedes
        them (:meth:`retain`). Uncommitted versions of ``steps`` are removed. Local."""
        if not self.node_leader:
            return
        for step in sorted(steps & set(self.steps())):
            if not self.is_committed(step):
                shutil.rmtree(self.step_dir(step), ignore_errors=True)
                continue
            shutil.rmtree(self.parked_dir(step), ignore_errors=True)
            os.replace(self.step_dir(step), self.parked_dir(step))
            log.warning("%s: committed step %d was not used by the restore; parked as %s "
                        "until a newer committed step supersedes it", self.root, step,
                        self.parked_dir(step).name)
        fsync_dir(self.root)

    # --------------------------------------------------------------- restore
    def inventory(self) -> dict[int, dict[str, Any]]:
        return {s: {"committed": self.is_committed(s), "have": self.shard_path(s).is_file()}
                for s in self.steps()}

    def _existing(self, step: int) -> Path:
        path = self.shard_path(step)
        if not path.is_file():
            raise CorruptCheckpointError(str(path), "shard is missing", rank=self.rank,
                                         step=step, level=self.name)
        return path

    def check_shard(self, step: int, world: int) -> None:
        """Verify this rank's shard of ``step`` completely (CorruptCheckpointError). Local."""
        Shard.check(self._existing(step), rank=self.rank, step=step, world=world,
                    level=self.name)

    def open_shard(self, step: int) -> Shard:
        return Shard.open(self._existing(step), rank=self.rank, step=step, level=self.name)
