"""Which tensors of a state are data-parallel replicas: the same bytes on every replica.

With dp > 1 the replicas of one (tp, pp) shard hold the same parameters and optimizer state,
so one snapshot can be shared between them (:mod:`ftkit.capture.slices`). A tensor is a
replica unless it is *rank-local* — what an ``ftkit.RNGState`` holds (each rank draws its
own streams) or what ftkit saves beside a loader
(:func:`ftkit.capture.rng.rank_local_indices`) — or its bytes differ between the replicas:
a per-rank tensor, an optimizer state sharded over DP (ZeRO). :func:`classify` finds out by
comparing a checksum of every other tensor across the DP group (at the first save and after
a restore); a tensor that differs, or that not every replica holds alike (path, dtype,
shape), is saved whole by every rank and named in one warning. Nothing is left out.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from ftkit.capture.flatten import Skeleton, TensorLeaf
from ftkit.capture.rng import rank_local_indices
from ftkit.capture.slices import kept_leaves
from ftkit.capture.staging import copy_leaf, host_bytes
from ftkit.comm.dist import DistComm
from ftkit.comm.topology import Topology
from ftkit.storage.shard import checksum

log = logging.getLogger(__name__)
#: the phase of the comparison's collective (it runs in ``save`` or ``restore``)
PHASE = "replicas"
#: a fingerprint's last field for a tensor on a GPU (kept whole: the restore of a shared
#: snapshot lands slices in host memory only, for now)
ON_DEVICE = "on-device"


@dataclasses.dataclass(frozen=True)
class Replication:
    """The tensors (indices into the state's tensor leaves, tree order) every replica holds
    alike, and why each other one is saved whole by every rank."""

    replicated: tuple[int, ...]
    whole: dict[int, str]


def classify(dc: DistComm, world_rank: int, tree: Skeleton, leaves: Sequence[TensorLeaf],
             *, step: int | None = None) -> Replication:
    """Compare every tensor that is not rank-local across the DP group ``dc`` (one hash pass
    over them: a tensor without host memory to read is copied to the host first). Every
    replica calls, each with its own state; all get the same answer. The group's first
    rank logs one warning naming the tensors that differ and the ranks (``world_rank``:
    each caller's rank in the job) that hold which bytes."""
    local = rank_local_indices(tree)
    mine = [None if i in local else _fingerprint(leaf) for i, leaf in enumerate(leaves)]
    every = dc.allgather({"rank": world_rank, "leaves": mine}, PHASE, step)
    ranks = [e["rank"] for e in every]
    replicated, whole = [], {}
    for i, leaf in enumerate(leaves):
        if i in local:
            whole[i] = "rank-local"
            continue
        prints = [e["leaves"][i] if i < len(e["leaves"]) else None for e in every]
        if all(p is not None and p == prints[0] for p in prints):
            if prints[0] and prints[0][-1] == ON_DEVICE:
                whole[i] = "on a GPU: shared snapshots hold host tensors only, for now"
            else:
                replicated.append(i)
            continue
        whole[i] = _differs(prints, ranks)
        if dc.rank == 0:
            log.warning("rank %d: %s%s differs between the data-parallel replicas (%s): "
                        "saved whole by every replica", world_rank,
                        "" if step is None else f"step {step}: ", leaf.path, whole[i])
    return Replication(tuple(replicated), whole)


def _fingerprint(leaf: TensorLeaf) -> list[Any]:
    """What must agree for two replicas' tensors to be one: place, kind, dtype, shape,
    size and a checksum of the bytes (:data:`ON_DEVICE` instead for a tensor on a GPU:
    it stays whole, its bytes are not read)."""
    device = getattr(getattr(leaf.source, "device", None), "type", "cpu")
    if leaf.kind == "torch" and device != "cpu":
        return [leaf.path, leaf.kind, leaf.dtype, list(leaf.shape), leaf.nbytes, ON_DEVICE]
    raw = host_bytes(leaf.source) if leaf.nbytes else np.empty(0, dtype=np.uint8)
    if raw is None:
        raw = np.empty(leaf.nbytes, dtype=np.uint8)
        copy_leaf(leaf, raw)
    return [leaf.path, leaf.kind, leaf.dtype, list(leaf.shape), leaf.nbytes, checksum(raw)]


def _differs(prints: Sequence[list[Any] | None], ranks: Sequence[int]) -> str:
    """Which ranks hold which version of one tensor, in words."""
    groups: dict[str, list[int]] = {}
    for p, r in zip(prints, ranks):
        groups.setdefault(json.dumps(p), []).append(r)
    words = []
    for key, rs in groups.items():
        p = json.loads(key)
        words.append(f"ranks {rs}: " + ("rank-local or no such tensor" if p is None else
                                        f"{p[0]} {p[2]} {p[3]} {p[5]}"))
    return "; ".join(words)


class Sharing:
    """Whether this rank's node-local shard is shared with its DP replicas, and what it
    writes then. On when asked (``FTKIT_SHARE_REPLICAS=on``), dp > 1 and every shard's
    replicas sit on a ring whose neighbours are on different nodes
    (:meth:`Topology.dp_ring`; else one warning at start and whole shards). A step due at
    the PFS stays whole (the PFS level flushes whole shards)."""

    def __init__(self, topo: Topology, enabled: bool, timeout: float) -> None:
        self.rank = topo.rank
        self.ring = topo.dp_ring() if enabled else None
        if enabled and self.ring is None and topo.rank == 0:
            log.warning("FTKIT_SHARE_REPLICAS=on, but %s: every rank keeps its whole shard",
                        "dp is 1" if topo.dp == 1 else "some shard's data-parallel replicas "
                        "cannot form a ring whose neighbours sit on different nodes (one node "
                        "holds more than half of them)")
        self.dc = DistComm(topo.dp_group, timeout) if self.ring is not None else None
        self._known: tuple[str, Replication] | None = None

    def leaves(self, tree: Skeleton, leaves: list[TensorLeaf], step: int,
               levels: Sequence[str]) -> tuple[list[TensorLeaf], dict[str, Any] | None]:
        """The tensors this rank writes at ``step`` and the shard's ``share`` table
        (:func:`~ftkit.capture.slices.kept_leaves`), or ``leaves`` and None (a whole shard:
        not sharing, a step due at the PFS, nothing replicated). Collective over the DP
        group when sharing: every replica's ``save`` calls."""
        if self.dc is None or self.ring is None or "pfs" in levels:
            return leaves, None
        replication = self._replication(tree, leaves, step)
        if not replication.replicated:
            return leaves, None
        return kept_leaves(leaves, replication.replicated, len(self.ring),
                           self.ring.index(self.rank))

    def forget(self) -> None:
        """Compare the replicas again at the next save (after a restore). Local."""
        self._known = None

    def free(self) -> None:
        """Free the DP group's communicator. Local."""
        if self.dc is not None:
            self.dc.free()
            self.dc = None

    def _replication(self, tree: Skeleton, leaves: list[TensorLeaf], step: int
                     ) -> Replication:
        """The classification of the last comparison while every replica's tensors keep
        the same places, dtypes and shapes; else (or on a replica that has none) a new
        one, on every replica. Collective over the DP group."""
        assert self.dc is not None
        mine = _layout(leaves)
        seen = self.dc.allgather([mine, self._known and self._known[0]], PHASE, step)
        if any(known != layout or known is None for layout, known in seen):
            self._known = (mine, classify(self.dc, self.rank, tree, leaves, step=step))
        assert self._known is not None
        return self._known[1]


def _layout(leaves: Sequence[TensorLeaf]) -> str:
    """A digest of the tensors' places, kinds, dtypes and shapes."""
    text = json.dumps([[x.path, x.kind, x.dtype, list(x.shape)] for x in leaves])
    return xxhash.xxh3_64_hexdigest(text.encode())
