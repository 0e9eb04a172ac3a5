"""The storage-level interface.

A level is a *scheme* (how redundancy is made) over a *store* (where bytes go) for a
*failure group* (what loss it survives), used every *interval* steps (SCR's descriptor).

Call order during one checkpoint of step ``s`` (docs/protocol.md); every level due at ``s`` gets::

    write_tentative(s, ...)   every rank, local           (phase write-local)
    encode(s)                 every rank, collective      (phase encode; redundancy levels)
    record_commit(s, rec)     coordinator only, durable   (phase decide)
    commit(s, rec)            every rank, on "commit"     (phase commit)
    discard(s)                every rank, on "abort"      (phase commit)

Redundancy levels (:class:`Redundancy`: partner, xor, rs) read the node-local shard written by
``local`` and add copies or parity in the same node-local step directory. They have both
halves: at restore each one *reports* what it holds intact, its :class:`Cover` *solves*
which lost shards it can rebuild (pure, the same on every rank), and the level *rebuilds*
them over MPI. :mod:`ftkit.recovery.plan` and :mod:`ftkit.recovery.rebuild` drive any level
through these methods; :mod:`ftkit.storage.registry` says which levels exist.
"""
from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import numpy as np

from ftkit.capture.flatten import TensorLeaf
from ftkit.errors import one_line
from ftkit.storage.shard import Shard


class Level(abc.ABC):
    """One storage level of one rank."""

    name: str = ""

    def write_tentative(self, step: int, meta: dict[str, Any], tree: Any,
                        leaves: list[TensorLeaf], buffers: list[np.ndarray]) -> None:
        """Store this rank's shard of ``step`` as tentative. Local call on every rank."""

    def encode(self, step: int) -> None:
        """Build redundancy for ``step``. Collective over the level's communicator."""

    def record_commit(self, step: int, record: dict[str, Any]) -> None:
        """Durably record the coordinator's commit decision. Coordinator only."""

    def commit(self, step: int, record: dict[str, Any]) -> None:
        """Make ``step`` permanent. Every rank."""

    @abc.abstractmethod
    def discard(self, step: int) -> None:
        """Drop this rank's tentative data of ``step`` (never a committed one). Every rank."""


#: one rank's report of a step at restore: ``"own"`` (None when its shard is intact, else why)
#: and, under each redundancy level's name, what that level holds (:meth:`Redundancy.held`)
Report = dict[str, Any]


def ranks_text(ranks: Sequence[int], node_name: Sequence[str]) -> str:
    """``rank(s) 2, 3 on node-1``: ranks and the nodes they run on, for a message."""
    nodes = sorted({node_name[r] for r in ranks})
    return f"rank(s) {', '.join(map(str, ranks))} on {', '.join(nodes)}"


class Streamed(Protocol):
    """One rank's side of one load of lost shards straight from a redundancy level: what it
    sends (:meth:`post`, non-blocking), its own shard when it is one of them (:meth:`open`),
    and the end (:meth:`finish`: ``ok`` once every rank loaded)."""

    def post(self) -> None: ...

    def open(self, world: int) -> Shard | None: ...

    def finish(self, ok: bool) -> None: ...


class Cover(abc.ABC):
    """Which ranks' shards one redundancy level can rebuild: its placement over the whole job
    (the same object on every rank) and the pure solver over every rank's report.

    A *part* is what the level rebuilds in one recovery: for ``kind == "copy"`` a list of
    ranks (whole copies sent back), for ``kind == "parity"`` ``{set id: [lost member
    indices]}`` (decoded from a set's parity)."""

    name: str = ""
    kind: Literal["copy", "parity"] = "copy"

    @abc.abstractmethod
    def solve(self, reports: Sequence[Report], have: list[bool],
              node_name: Sequence[str]) -> tuple[Any, list[str]]:
        """The part of the lost shards (``have[r]`` False) this level rebuilds, marking them
        in ``have``, and why it cannot rebuild others it covers (one line each; empty part:
        falsy). Pure."""

    @abc.abstractmethod
    def rebuilt(self, part: Any) -> list[int]:
        """The ranks whose shards ``part`` rebuilds."""

    def streams(self, part: Any, reports: Sequence[Report]) -> dict[int, Any] | None:
        """Where each shard of ``part`` can be loaded from straight into its rank's live
        state (lost rank -> the rank or the set it streams from, for the events), or None
        when the level cannot (its part is rebuilt on disk first). Pure."""
        return None


class Redundancy(Level):
    """A level that protects node-local shards on other nodes (both halves: encode at save,
    report and rebuild at restore)."""

    cover: Cover

    @abc.abstractmethod
    def held(self, step: int, world: int, *, data: bool = True) -> Any:
        """What this rank holds of the level for ``step`` (its entry in the :data:`Report`);
        without ``data`` only headers are read. Local."""

    @abc.abstractmethod
    def unusable(self, why: str) -> Any:
        """The report entry when :meth:`held` itself failed: everything this rank holds of
        the level is unusable, for reason ``why``."""

    def report(self, step: int, world: int, *, data: bool = True) -> Any:
        """:meth:`held`, and never an exception (every rank must reach the next
        collective): any failure makes this rank's part of the level unusable. Local."""
        try:
            return self.held(step, world, data=data)
        except Exception as exc:  # noqa: BLE001 - any failure: the level's data is unusable
            return self.unusable(one_line(exc))

    def stream(self, step: int, part: Any, reports: Sequence[Report]) -> Streamed | None:
        """This rank's side of loading the shards of ``part`` straight into their ranks'
        live state (:meth:`Cover.streams` said the level can), or None when it has no side.
        Every rank calls with the same arguments."""
        return None

    @abc.abstractmethod
    def rebuild(self, step: int, part: Any, reports: Sequence[Report],
                have: Sequence[bool]) -> None:
        """Rebuild the shards of ``part`` (the cover's solution; ``have[r]``: rank r's shard
        is intact or was rebuilt by a level before this one). Every rank calls with the same
        arguments; a rank with nothing to do returns."""

    def reprotect(self, step: int, reports: Sequence[Report]) -> list[str]:
        """After a rebuild of ``step`` (every shard intact again): re-establish what the
        reports say this level lost, and say what that was (one phrase each; empty: nothing
        was lost). The default re-encodes the whole step. Every rank calls with the same
        reports."""
        self.encode(step)
        return [f"{self.name}: step re-encoded"]

    @abc.abstractmethod
    def free(self) -> None:
        """Unmap the level's slots and free its communicator. Local."""
