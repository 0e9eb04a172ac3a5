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

from ftkit.capture.flatten import Skeleton, TensorLeaf
from ftkit.capture.rng import rank_local_indices
from ftkit.capture.staging import copy_leaf, host_bytes
from ftkit.comm.dist import DistComm
from ftkit.storage.shard import checksum

log = logging.getLogger(__name__)
#: the phase of the comparison's collective (it runs in ``save`` or ``restore``)
PHASE = "replicas"


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
    size and a checksum of the bytes."""
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
