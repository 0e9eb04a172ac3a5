"""A lost shard loaded straight from redundancy into its rank's live state; what the loss
took is made again after the load (on the checkpoint thread when saves are asynchronous).

When one level rebuilds every shard a step lost and can stream them (its cover says so:
``partner`` from a whole copy on another node, ``xor`` and ``rs`` by decoding from the set
as the pieces arrive), the restore does not rebuild them on disk first: each lost rank receives its shard
straight into its live tensors, checked as it lands (:mod:`ftkit.storage.redundancy.fetch`,
:mod:`ftkit.storage.redundancy.decodeload`), while the other ranks load their own shards
from their nodes. Only then is the step repaired (:class:`Repair`): the lost shards are
written into node-local slots from the same copies or parity and the copies and parity the
lost node held are made again (:func:`ftkit.recovery.rebuild.execute`). Until the repair
ends, the step is protected as the failure left it: a second failure that takes a copy or
parity still needed costs this step (the restore falls back to an older step or the PFS,
docs/protocol.md), never a torn one.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ftkit.recovery.plan import Plan
from ftkit.storage.level import Cover, Report, Streamed
from ftkit.storage.levels import Levels
from ftkit.storage.shard import Shard

#: a lost rank -> where it loads its shard from (the rank holding its copy, or its set)
Sources = dict[int, Any]


def sources(plan: Plan, covers: Sequence[Cover], reports: Sequence[Report]
            ) -> Sources | None:
    """Where each lost shard of ``plan`` loads from straight into its rank's live state:
    only when one level rebuilds all of them and its cover can stream them (a whole copy,
    an erasure decode); else None (rebuilt on disk first: a set that leans on a shard
    another level rebuilds, a level that cannot stream). Pure."""
    if not plan.lost or len(plan.parts) != 1:
        return None
    [(name, part)] = plan.parts.items()
    return next(cover for cover in covers if cover.name == name).streams(part, reports)


@dataclasses.dataclass
class Repair:
    """What a restore that loaded from redundancy still owes its step: the rebuild of the
    lost shards into node-local slots and the re-protection (every rank's ``reports``)."""

    plan: Plan
    reports: list[Report]
    step_levels: list[str]


class Fetch:
    """One load attempt's streams from redundancy on one rank (every rank builds one with
    the same ``repair``; None: nothing lost): what it sends, and its own shard when it was
    lost."""

    def __init__(self, levels: Levels, step: int, repair: Repair | None) -> None:
        self.streams: list[Streamed] = []
        if repair is not None:
            for name, part in repair.plan.parts.items():
                got = levels.redundant[name].stream(step, part, repair.reports)
                if got is not None:
                    self.streams.append(got)

    def post(self) -> None:
        """Post this rank's sends (non-blocking). Local."""
        for stream in self.streams:
            stream.post()

    def open(self, world: int) -> Shard | None:
        """This rank's shard streamed from redundancy (header checked), or None when its
        own is intact. Local."""
        for stream in self.streams:
            shard = stream.open(world)
            if shard is not None:
                return shard
        return None

    def finish(self, ok: bool) -> None:
        """End the streams (``ok``: every rank loaded). Local."""
        for stream in self.streams:
            stream.finish(ok)
