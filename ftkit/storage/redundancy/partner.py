"""Partner level: a copy of every rank's shard on another node.

``step-<s>/partner-<r>.ftk`` on node B is a byte copy of rank r's ``rank-<r>.ftk`` (r lives on
node A != B), streamed over MPI by :func:`~ftkit.storage.redundancy.transfer.exchange`. The copy is
self-checking (header checksum + one checksum per tensor) and checked twice: while it
streams in (a copy corrupted in transfer makes ``encode`` raise on the receiving rank, which
votes no, so the step is aborted) and at restore (a copy damaged at rest is never used). A
shard sent back at rebuild is checked the same way on the rank that receives it.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ftkit.comm.dist import DistComm
from ftkit.errors import CorruptCheckpointError
from ftkit.faults import Faults
from ftkit.storage.level import Cover, Redundancy, Report
from ftkit.storage.local import LocalLevel
from ftkit.storage.redundancy.fetch import CopySend, RemoteShard
from ftkit.storage.redundancy.transfer import Verify, exchange
from ftkit.storage.shard import Shard
from ftkit.storage.site import Site
from ftkit.storage.slots import Slots

log = logging.getLogger(__name__)


class PartnerCover(Cover):
    """``partners[r]`` holds rank r's copy (on another node)."""

    name = "partner"
    kind = "copy"

    def __init__(self, partners: Sequence[int]) -> None:
        self.partners = list(partners)

    def solve(self, reports: Sequence[Report], have: list[bool],
              node_name: Sequence[str]) -> tuple[list[int], list[str]]:
        """Lost ranks whose copy is intact on their partner. Pure."""
        part, why = [], []
        for r in (r for r, ok in enumerate(have) if not ok):
            holder = self.partners[r]
            state = (reports[holder].get(self.name) or {}).get(str(r), "missing")
            if state is None:
                part.append(r)
                have[r] = True
            else:
                why.append(f"{self.name}: the copy of rank {r} on rank {holder} "
                           f"({node_name[holder]}) is {_short(state)}")
        return part, why

    def rebuilt(self, part: list[int]) -> list[int]:
        return list(part)

    def streams(self, part: list[int], reports: Sequence[Report]) -> dict[int, int]:
        """Each lost rank loads from the rank holding its copy. Pure."""
        return {r: self.partners[r] for r in part}


def _short(state: object) -> str:
    if state == "missing":
        return "missing"
    text = str(state)
    return "damaged (" + (text if len(text) < 160 else text[:157] + "...") + ")"


class PartnerLevel(Redundancy):
    """Rank-side partner level. ``partners[r]`` holds rank r's copy."""

    name = "partner"
    cover: PartnerCover

    @classmethod
    def build(cls, site: Site) -> PartnerLevel:
        """The partner level of this rank: copies on the next node (placement raises the
        same ConfigError on every rank when the job has one node). All ranks call."""
        return cls(site.local, DistComm(site.dc.comm, site.dc.timeout),
                   site.topo.partner_map(), site.faults)

    def __init__(self, local: LocalLevel, dc: DistComm, partners: list[int],
                 faults: Faults) -> None:
        self.local = local
        self.dc = dc                     # a communicator of its own (tags never collide)
        self.partners = partners
        self.cover = PartnerCover(partners)
        self.rank = dc.rank
        self.sources = [q for q, p in enumerate(partners) if p == self.rank]
        self.faults = faults
        # the copies this rank holds live in reused slots, like its own shards
        self.slots = {q: Slots(local.root, self.rank, of=f"partner-{q}") for q in self.sources}

    def copy_path(self, step: int, source: int) -> Path:
        return self.local.step_dir(step) / f"partner-{source}.ftk"

    def stream(self, step: int, part: Any, reports: Sequence[Report]) -> CopyStream:
        return CopyStream(self, step, list(part))

    def _verify(self, step: int, *, mine: bool = False) -> Verify:
        """Checks for received shards of ``step``: the sender's own shard, or (``mine``)
        this rank's shard sent back from its copy."""
        def tamper(buf: np.ndarray) -> bool:
            return self.faults.corrupt_buffer(buf, level=self.name, step=step)
        return Verify(self.name, step, self.dc.size, tamper=tamper,
                      owner=(lambda _source: self.rank) if mine else None)

    def encode(self, step: int) -> None:
        """Send my shard to my partner (from its mapped slot), receive the shards I hold
        straight into slots of mine, verifying every byte as it lands. Collective over dc;
        raises CorruptCheckpointError on a receiver whose copy arrived damaged (its peers
        complete normally): the receiver is the rank that reports a shard damaged on its
        owner after it was written, too (the owner does not re-read it first)."""
        mine = self.local.shard_path(step)
        view = self.local.slots.view_of(mine)
        exchange(self.dc, [(mine, self.partners[self.rank])],
                 [(self.copy_path(step, q), q) for q in self.sources], "encode", step,
                 verify=self._verify(step), views={mine: view} if view is not None else {},
                 slots=self.slots)

    def close(self) -> None:
        """Unmap the slots of the copies (their files stay). Local."""
        for slots in self.slots.values():
            slots.close()

    def free(self) -> None:
        """Unmap the slots and free the level's communicator. Local."""
        self.close()
        self.dc.free()

    def discard(self, step: int) -> None:
        """Remove my uncommitted copies of ``step``: only regular files in a private step
        directory (a linked step directory never makes ftkit unlink inside its target)."""
        if not self.local.is_committed(step):
            for q in self.sources:
                path = self.copy_path(step, q)
                if self.local.file_problem(path) is None:
                    path.unlink(missing_ok=True)

    def held(self, step: int, world: int, *, data: bool = True) -> dict[str, str | None]:
        """``{str(source rank): None if my copy of its shard is intact, else why}`` (absent
        copies are left out). Any failure to read or check a copy makes it unusable, and so
        does a copy or step directory that is not ours (a planted link: never followed).
        Without ``data`` no tensor byte is read (headers only): a copy used for a rebuild
        is verified as it streams to its rank. Local."""
        out: dict[str, str | None] = {}
        for q in self.sources:
            path = self.copy_path(step, q)
            try:
                problem = self.local.file_problem(path)
                if problem == "missing":
                    continue
                if problem is not None:
                    raise CorruptCheckpointError(str(path), problem, rank=q, step=step,
                                                 level=self.name)
                Shard.check(path, rank=q, step=step, world=world, level=self.name,
                            data=data)
                out[str(q)] = None
            except Exception as exc:  # noqa: BLE001 - any failure: the copy is unusable
                why = str(exc) if isinstance(exc, CorruptCheckpointError) else \
                    f"{path} (level {self.name}, rank {q}, step {step}): " \
                    f"{type(exc).__name__}: {exc}"
                log.warning("partner copy unusable: %s", why)
                out[str(q)] = why
        return out

    def unusable(self, why: str) -> dict[str, str | None]:
        return {str(q): why for q in self.sources}

    def reprotect(self, step: int, reports: Sequence[Report]) -> list[str]:
        """Send again only the copies the reports name missing or damaged (those a lost node
        held): each such source streams its shard to its partner, nothing else moves. Every
        rank calls (with the same reports)."""
        lost = [q for q, holder in enumerate(self.partners)
                if (reports[holder].get(self.name) or {}).get(str(q), "missing") is not None]
        if not lost:
            return []
        mine = self.local.shard_path(step)
        sends = [(mine, self.partners[self.rank])] if self.rank in lost else []
        recvs = [(self.copy_path(step, q), q) for q in self.sources if q in lost]
        if recvs:
            self.local.ensure_step_dir(step)
        exchange(self.dc, sends, recvs, "restore-rebuild", step, verify=self._verify(step),
                 slots=self.slots)
        return [f"{self.name}: copies of ranks {lost} sent again"]

    def rebuild(self, step: int, part: Any, reports: Sequence[Report] = (),
                have: Sequence[bool] = ()) -> None:
        """Send the copies I hold of the ``part`` ranks to them; each receives its shard
        straight into a free slot of its node-local level (chunk by chunk, each checked as
        it lands), published as its shard. Every rank calls (a rank that neither holds nor
        lost one returns at once)."""
        lost = list(part)
        sends = [(self.copy_path(step, q), q) for q in self.sources if q in lost]
        holder = self.partners[self.rank]
        if self.rank in lost:
            self.local.ensure_step_dir(step)
        recvs = [(self.local.shard_path(step), holder)] if self.rank in lost else []
        exchange(self.dc, sends, recvs, "restore-rebuild", step,
                 verify=self._verify(step, mine=True), slots={holder: self.local.slots})


class CopyStream:
    """One load of the ``lost`` ranks' shards straight from their copies, on one rank of the
    partner level's communicator: the copies it holds for them are sent
    (:class:`~ftkit.storage.redundancy.fetch.CopySend`), its own shard is received when it
    is lost (:class:`~ftkit.storage.redundancy.fetch.RemoteShard`)."""

    def __init__(self, level: PartnerLevel, step: int, lost: list[int]) -> None:
        self.level, self.step, self.lost = level, step, lost
        self.sends: list[CopySend] = []

    def post(self) -> None:
        """Post the sends of the copies this rank holds for lost ranks (a copy that does
        not open tells its rank at once, and raises). Local."""
        lv, dc = self.level, self.level.dc
        for q in self.lost:
            if lv.partners[q] == dc.rank:
                send = CopySend(lv.copy_path(self.step, q), q,
                                dc.bulk_tag(self.step, dc.rank, q), step=self.step,
                                level=lv.name)
                self.sends.append(send)
                send.post(dc.comm)

    def open(self, world: int) -> RemoteShard | None:
        """This rank's shard from its copy (header received and checked), or None when it
        is not lost. Local (the holder posts the sends)."""
        lv, dc = self.level, self.level.dc
        if dc.rank not in self.lost:
            return None
        holder = lv.partners[dc.rank]
        where = Path(f"{lv.name} copy of rank {dc.rank}'s shard of step {self.step} on rank "
                     f"{holder}")
        return RemoteShard.receive(dc, holder, dc.bulk_tag(self.step, holder, dc.rank),
                                   path=where, rank=dc.rank, step=self.step, world=world,
                                   level=lv.name)

    def finish(self, ok: bool) -> None:
        """Complete the sends (``ok``: every rank loaded) or release them. Local."""
        for send in self.sends:
            send.finish(self.level.dc, ok)
        self.sends = []
