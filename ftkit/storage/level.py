"""The storage-level interface.

A level is a *scheme* (how redundancy is made) over a *store* (where bytes go) for a
*failure group* (what loss it survives), used every *interval* steps (SCR's descriptor).

Call order during one checkpoint of step ``s`` (docs/protocol.md); every level due at ``s`` gets::

    write_tentative(s, ...)   every rank, local           (phase write-local)
    encode(s)                 every rank, collective      (phase encode; redundancy levels)
    record_commit(s, rec)     coordinator only, durable   (phase decide)
    commit(s, rec)            every rank, on "commit"     (phase commit)
    discard(s)                every rank, on "abort"      (phase commit)

Redundancy levels (partner, xor, rs) read the node-local shard written by ``local`` and add
copies or parity in the same node-local step directory; at restore they report what they
hold intact and rebuild lost shards over MPI (see :mod:`ftkit.recovery.rebuild`).
"""
from __future__ import annotations

import abc
from typing import Any

import numpy as np

from ftkit.capture.flatten import TensorLeaf


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
