"""Restore the newest step that is committed and intact on every rank (DESIGN §4).

Phases: ``restore-discover`` (ranks exchange inventories over MPI and verify their own shard
of each candidate, newest first), ``restore-rebuild`` (nothing to rebuild with the local
level alone), ``restore-load``. A rank only reads its own node's directory.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, MutableMapping
from typing import Any

from ftkit.capture.apply import load_into
from ftkit.capture.flatten import leaf_from_bytes, unflatten
from ftkit.comm.dist import DistComm
from ftkit.errors import CheckpointError, CorruptCheckpointError
from ftkit.storage.local import LocalLevel
from ftkit.storage.shard import leaves_of
from ftkit.testing.faults import Faults

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Discovery:
    """Result of discovery, identical on every rank."""

    step: int                       # 0 when nothing usable is committed
    committed: list[int]            # every step committed somewhere, newest first
    skipped: dict[int, dict[int, str]]


def discover(dc: DistComm, level: LocalLevel, faults: Faults,
             emit: Callable[..., None]) -> Discovery:
    """Agree on the newest committed step that every rank holds intact. All ranks call."""
    faults.fire("restore-discover", None)
    inv = level.inventory()
    mine = {"node": level.root.name,
            "steps": {str(s): {"c": v["committed"], "h": v["have"], "w": level.record_world(s)}
                      for s, v in inv.items()}}
    gathered = dc.allgather(mine, "restore-discover")
    nodes = [g["node"] for g in gathered]
    every = [g["steps"] for g in gathered]
    committed = sorted({int(s) for inv_r in every for s, v in inv_r.items() if v["c"]},
                       reverse=True)
    _refuse_foreign_world(every, committed, dc.size, level)
    skipped: dict[int, dict[int, str]] = {}
    for step in committed:
        missing = {r: f"shard of step {step} missing on {nodes[r]}"
                   for r, inv_r in enumerate(every) if not inv_r.get(str(step), {}).get("h")}
        failures = missing or dc.agree(_verify(level, step, dc.size), "restore-discover", step)
        if not failures:
            return Discovery(step, committed, skipped)
        skipped[step] = failures
        if dc.rank == 0:
            log.warning("restore: committed step %d is unusable, trying an older one: %s",
                        step, "; ".join(f"rank {r}: {f}" for r, f in failures.items()))
        emit("restore-skip", step=step, failures=failures)
    return Discovery(0, committed, skipped)


def _verify(level: LocalLevel, step: int, world: int) -> str | None:
    """Check this rank's shard of ``step`` completely; a failure description or None."""
    try:
        with level.open_shard(step) as shard:
            shard.check_identity(rank=level.rank, step=step, world=world)
            shard.verify()
    except CorruptCheckpointError as exc:
        return str(exc)
    return None


def _refuse_foreign_world(every: list[dict[str, Any]], committed: list[int], world: int,
                          level: LocalLevel) -> None:
    """A committed step written by another world size must not be silently overwritten."""
    for step in committed:
        worlds = {v["w"] for inv in every for s, v in inv.items()
                  if int(s) == step and v.get("w") is not None}
        other = sorted(w for w in worlds if w != world)
        if other:
            raise CheckpointError(step, {}, message=(
                f"the committed step {step} under {level.root.parent} was written by a job of "
                f"{other[0]} ranks, and this job has {world}; relaunch with {other[0]} ranks "
                f"(or use another FTKIT_JOB); nothing was modified"))


def load(dc: DistComm, level: LocalLevel, faults: Faults, step: int,
         state: MutableMapping[str, Any]) -> None:
    """Load this rank's shard of ``step`` into ``state``; the same error everywhere on
    failure. All ranks call."""
    def _load() -> None:
        faults.fire("restore-load", step)
        with level.open_shard(step) as shard:
            leaves = leaves_of(shard.header)
            tensors = [leaf_from_bytes(leaf, shard.raw(i).copy())
                       for i, leaf in enumerate(leaves)]
            tree = unflatten(shard.header["tree"], tensors)
        if not isinstance(tree, dict):
            raise CheckpointError(step, {}, message=f"{shard.path}: state root is not a dict")
        load_into(state, tree, step)
    dc.run(_load, "restore-load", step)
