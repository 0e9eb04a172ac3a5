"""The storage-level interface.

A level is a *scheme* (how redundancy is made) over a *store* (where bytes go) for a
*failure group* (what loss it survives), used every *interval* steps (SCR's descriptor).

Call order during one checkpoint of step ``s`` (DESIGN §4)::

    write_tentative(s, ...)   every rank, local           (phase write-local)
    encode(s)                 every rank, collective      (phase encode; redundancy levels)
    record_commit(s)          coordinator only, durable   (phase decide)
    commit(s) | discard(s)    every rank                  (phase commit)

and during restore::

    inventory()               every rank, local           (phase restore-discover)
    open_shard(s)             every rank, local           (phase restore-load)
"""
from __future__ import annotations

import abc
from typing import Any

import numpy as np

from ftkit.capture.flatten import TensorLeaf
from ftkit.storage.shard import Shard


class Level(abc.ABC):
    """One storage level of one rank."""

    name: str = ""

    @abc.abstractmethod
    def write_tentative(self, step: int, meta: dict[str, Any], tree: Any,
                        leaves: list[TensorLeaf], buffers: list[np.ndarray]) -> None:
        """Store this rank's shard of ``step`` as tentative. Local call on every rank."""

    def encode(self, step: int) -> None:
        """Build redundancy for ``step``. Collective over the level's communicator."""

    @abc.abstractmethod
    def record_commit(self, step: int, record: dict[str, Any]) -> None:
        """Durably record the coordinator's commit decision. Coordinator only."""

    @abc.abstractmethod
    def commit(self, step: int, record: dict[str, Any]) -> None:
        """Make ``step`` permanent. Every rank (the node leader writes the node's record)."""

    @abc.abstractmethod
    def discard(self, step: int) -> None:
        """Drop this rank's tentative data of ``step``. Every rank."""

    @abc.abstractmethod
    def inventory(self) -> dict[int, dict[str, Any]]:
        """``{step: {"committed": bool, "have": bool}}`` as seen from this rank. Local."""

    @abc.abstractmethod
    def open_shard(self, step: int) -> Shard:
        """Open and validate this rank's shard of ``step`` (CorruptCheckpointError). Local."""
