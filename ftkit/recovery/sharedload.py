"""Load a step whose node-local shards the data-parallel replicas shared.

A shared shard (header format 2, :mod:`ftkit.capture.slices`) holds its rank's other tensors
whole and two of the D slices of the tensors the replicas hold alike. Its entries are read
like any shard's, each into the bytes of its destination: a whole tensor's, or the span of a
replicated tensor it holds (:func:`entry_dests`). The slices a rank does not keep then come
from the replica that owns them (ring position k sends slice k, the one position k - 1 also
keeps) over MPI, straight into the live tensors, each span hashed where it landed and
compared with the checksum the sender's header gives it (:func:`exchange`). Any mismatch or
timeout fails the load on every rank like a damaged shard.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import xxhash
from mpi4py import MPI

from ftkit.capture.inplace import Reading
from ftkit.capture.slices import holders, kept, plan, unshare
from ftkit.comm.dist import DistComm
from ftkit.errors import CorruptCheckpointError
from ftkit.storage.redundancy.fetch import cuts, receive_hashed
from ftkit.storage.shard import SHARED, XXH3, Shard, leaves_of

PHASE = "restore-load"
_GPU = ("a replicated tensor on a GPU cannot be loaded from a shard shared by DP replicas "
        "yet")


def entry_dests(shard: Shard, reading: Reading) -> list[Any]:
    """The destination of each of ``shard``'s entries, from ``reading`` (planned over the
    whole state, :func:`ftkit.storage.shard.tree_leaves`): a whole tensor's, or the bytes
    of the span it holds of a replicated one. ValueError when such a tensor's destination
    is not host memory (a GPU tensor: not loaded from shared shards yet)."""
    if shard.header.get("format") != SHARED:
        return reading.dests
    share = shard.header["share"]
    _, places = unshare(share, leaves_of(shard.header))
    out = []
    for j, ((i, start), t) in enumerate(zip(places, shard.tensors)):
        dest = reading.dests[i]
        out.append(dest if j < len(share["whole"]) else
                   _host(dest)[start:start + t["nbytes"]])
    return out


def share_info(shard: Shard) -> dict[str, Any] | None:
    """What the other replicas need of this rank's shared shard: its (tp, pp) shard, ring
    size and position, and the checksum of every span of each slice it keeps; None for a
    whole shard. Local."""
    header = shard.header
    if header.get("format") != SHARED:
        return None
    share, topo = header["share"], header.get("topology", {})
    sums: dict[str, list[str]] = {}
    for j, (k, *_rest) in enumerate(share["spans"]):
        sums.setdefault(str(k), []).append(shard.tensors[len(share["whole"]) + j]["checksum"])
    return {"key": [topo.get("tp_idx"), topo.get("pp_idx")], "parts": share["parts"],
            "position": share["position"], "sums": sums}


def exchange(dc: DistComm, shard: Shard, reading: Reading, step: int) -> None:
    """Give every replica the slices it does not keep: ring position k sends slice k's
    spans from its loaded tensors to every position that does not keep it, each receives
    them into its own tensors and checks them (CorruptCheckpointError naming the sender,
    the slice and the tensor; ProtocolTimeout). Nothing moves when no shard is shared.
    All ranks call, after every rank read its own shard."""
    mine = share_info(shard)
    every = dc.allgather(mine, PHASE, step)
    if mine is None:
        return
    ring = {e["position"]: r for r, e in enumerate(every) if e and e["key"] == mine["key"]}
    parts, me = mine["parts"], mine["position"]
    if sorted(ring) != list(range(parts)):
        raise CorruptCheckpointError(str(shard.path), f"the ring of {parts} replicas is not "
                                     f"whole: positions {sorted(ring)}", rank=dc.rank, step=step)
    slices = _slices(shard, parts)
    sends: list[MPI.Request] = []
    keep: list[np.ndarray] = []
    for p in sorted(set(range(parts)) - set(holders(me, parts))):   # I own slice me
        tag = dc.bulk_tag(step, dc.rank, ring[p])
        for view, _ in _views(shard, reading, slices[me]):
            for a, n in cuts(0, len(view)):
                sends.append(dc.comm.Isend([view[a:a + n], MPI.BYTE], ring[p], tag))
                keep.append(view)
    try:
        for k in range(parts):
            if k in kept(me, parts):
                continue
            _receive_slice(dc, shard, reading, slices[k], k, ring[k], every[ring[k]], step)
    except BaseException:
        dc.release(sends, keep)
        raise
    dc.waitall_bulk(sends, PHASE, step, sum(v.nbytes for v in keep), keep)


def _receive_slice(dc: DistComm, shard: Shard, reading: Reading, piece: Any, k: int,
                   owner: int, info: dict[str, Any], step: int) -> None:
    """Slice ``k`` from its ``owner`` into this rank's tensors, each span hashed as its
    pieces land and compared with the checksum of the owner's entry (``info["sums"]``).
    CorruptCheckpointError naming the tensor, the slice and the owner on a mismatch."""
    tag = dc.bulk_tag(step, owner, dc.rank)
    sums = info["sums"].get(str(k), [])
    for j, (view, path) in enumerate(_views(shard, reading, piece)):
        h = xxhash.xxh3_64()
        receive_hashed(dc, owner, tag, [view[a:a + n] for a, n in cuts(0, len(view))], h,
                       step)
        if j >= len(sums) or XXH3 + h.hexdigest() != sums[j]:
            raise CorruptCheckpointError(
                str(shard.path), f"slice {k} of {path} sent by rank {owner} does not match "
                f"its checksum", rank=dc.rank, step=step)


def _slices(shard: Shard, parts: int) -> list[Any]:
    """The D slices of the shared shard's replicated tensors (both ends cut them alike)."""
    described = shard.header["share"]["replicated"]
    return plan([(d["index"], d["nbytes"]) for d in described], parts)


def _views(shard: Shard, reading: Reading, piece: Any) -> list[tuple[np.ndarray, str]]:
    """The destination bytes of each span of a slice, with its tensor's path."""
    paths = {d["index"]: d["path"] for d in shard.header["share"]["replicated"]}
    out = []
    for span in piece.spans:
        dest = _host(reading.dests[span.leaf])
        out.append((dest[span.start:span.start + span.nbytes], paths[span.leaf]))
    return out


def _host(dest: Any) -> np.ndarray:
    """A destination in host memory (ValueError for a GPU tensor's)."""
    if isinstance(dest, np.ndarray):
        return dest
    raise ValueError(_GPU)
