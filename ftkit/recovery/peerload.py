"""A lost shard loaded straight from a whole copy on another node; what the loss took is
made again after the load (on the checkpoint thread when saves are asynchronous).

When every shard a step lost has a whole copy on another node (a ``copy`` level such as
``partner``), the restore does not rebuild them on disk first: each lost rank receives its
shard from the rank that holds the copy straight into its live tensors, checked as it lands
(:mod:`ftkit.storage.redundancy.fetch`), while the other ranks load their own shards from
their nodes. Only then is the step repaired (:class:`Repair`): the lost shards are written
into node-local slots from the same copies and the copies and parity the lost node held are
made again (:func:`ftkit.recovery.rebuild.execute`). Until the repair ends, the step is
protected as the failure left it: a second failure that takes a copy still needed costs this
step (the restore falls back to an older step or the PFS, docs/protocol.md), never a torn one.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from ftkit.comm.dist import DistComm
from ftkit.recovery.plan import Plan
from ftkit.storage.level import Cover, Report
from ftkit.storage.levels import Levels
from ftkit.storage.redundancy.fetch import CopySend, RemoteShard

#: a lost rank -> (the level whose copy it loads, the rank that holds the copy)
Sources = dict[int, tuple[str, int]]


def sources(plan: Plan, covers: Sequence[Cover]) -> Sources | None:
    """Where each lost shard of ``plan`` can be loaded from: only when every one is rebuilt
    from a whole copy whose holder the cover names; else None (rebuild on disk first: a
    decoded shard, or a set that leans on a rebuilt one). Pure."""
    if not plan.lost or any(kind != "copy" for kind in plan.kinds.values()):
        return None
    by_name = {cover.name: cover for cover in covers}
    out: Sources = {}
    for name, part in plan.parts.items():
        for rank in by_name[name].rebuilt(part):
            holder = by_name[name].holder(rank)
            if holder is None:
                return None
            out[rank] = (name, holder)
    return out


@dataclasses.dataclass
class Repair:
    """What a restore that loaded from copies still owes its step: the rebuild of the lost
    shards into node-local slots and the re-protection (every rank's ``reports``)."""

    plan: Plan
    reports: list[Report]
    step_levels: list[str]
    sources: Sources


class Fetch:
    """One load's transfers from copies, on one rank: the sends of the copies it holds for
    lost ranks (:meth:`post`), the receiving shard when its own was lost (:meth:`open`).
    Every rank builds one per load attempt with the same ``sources``."""

    def __init__(self, dc: DistComm, levels: Levels, step: int, sources: Sources) -> None:
        self.dc, self.levels, self.step, self.sources = dc, levels, step, sources
        self.sends: list[CopySend] = []

    def post(self) -> None:
        """Post the sends of every copy this rank holds for a lost rank. A copy that cannot
        be opened sends sizes (0, 0), so its rank fails at once, and raises. Local."""
        dc = self.dc
        for rank, (name, holder) in sorted(self.sources.items()):
            if holder != dc.rank:
                continue
            path = self.levels.redundant[name].copy_of(self.step, rank)
            send = CopySend(path or Path(f"{name} copy of rank {rank}"), rank,
                            dc.bulk_tag(self.step, dc.rank, rank), step=self.step, level=name)
            self.sends.append(send)
            send.post(dc.comm)

    def open(self, world: int) -> RemoteShard | None:
        """This rank's shard from the rank holding its copy (header received and checked),
        or None when its own shard is intact. CorruptCheckpointError when the header is
        not this rank's shard. Local (the holder posts the sends)."""
        dc = self.dc
        if dc.rank not in self.sources:
            return None
        name, holder = self.sources[dc.rank]
        where = Path(f"{name} copy of rank {dc.rank}'s shard of step {self.step} on rank "
                     f"{holder}")
        return RemoteShard.receive(dc, holder, dc.bulk_tag(self.step, holder, dc.rank),
                                   path=where, rank=dc.rank, step=self.step, world=world,
                                   level=name)

    def finish(self, ok: bool) -> None:
        """Complete the sends (``ok``: every rank loaded, so they were all received) or
        release them. Local."""
        for send in self.sends:
            send.finish(self.dc, ok)
        self.sends = []
