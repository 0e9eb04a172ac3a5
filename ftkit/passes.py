"""Passes over a state's bytes, counted where they happen.

The in-memory levels exist so that a checkpoint costs about one copy of the state; what it
costs is the number of times its bytes are touched. The few functions that touch bulk bytes
(staging, checksums, file writes, loads, MPI transfers, parity arithmetic) call
:func:`count` with the bytes they moved, by kind:

* ``copy`` — memory to memory (staging, restore from a mapped shard into new memory or
  into live tensors, parity accumulators);
* ``hash`` — a checksum over data (xxh3, whether over a buffer or as bytes stream in);
* ``read`` — bytes read from a file into new memory (HDF5 datasets);
* ``write`` — bytes written to a file (node-local shards, copies, parity, HDF5);
* ``send`` / ``recv`` — bulk MPI transfers (partner copies, parity rings, flush gathers);
* ``encode`` — parity arithmetic (XOR, GF(256) products).

Beside them, the small collectives of the protocol are counted (:func:`collective`: the
rounds a process completed and the bytes they delivered to it; ``bench/protocol.py``).

Counters are per process (every rank has its own) and cumulative; :func:`snapshot` and
:func:`since` give what one operation cost, :func:`passes` divides by the state's bytes.
``bench/levels.py`` reports them per operation. Thread-safe; the cost is one lock per call,
and calls are per tensor or per chunk, never per byte. This module imports nothing.
"""
from __future__ import annotations

import threading

KINDS = ("copy", "hash", "read", "write", "send", "recv", "encode")
#: the counters of collective operations, not passes over the state
COLLECTIVE = ("rounds", "bytes")

_lock = threading.Lock()
_bytes = dict.fromkeys(KINDS, 0)
_collective = dict.fromkeys(COLLECTIVE, 0)


def count(kind: str, nbytes: int) -> None:
    """Record a pass of ``kind`` over ``nbytes`` bytes (local, any thread)."""
    with _lock:
        _bytes[kind] += int(nbytes)


def collective(nbytes: int, rounds: int = 1) -> None:
    """Record ``rounds`` completed collective operations that delivered ``nbytes`` to this
    process (local, any thread)."""
    with _lock:
        _collective["rounds"] += rounds
        _collective["bytes"] += int(nbytes)


def collective_counts() -> dict[str, int]:
    """The collective operations (``rounds``) this process completed and the bytes they
    delivered to it, so far."""
    with _lock:
        return dict(_collective)


def snapshot() -> dict[str, int]:
    """Bytes counted so far in this process, by kind."""
    with _lock:
        return dict(_bytes)


def since(before: dict[str, int]) -> dict[str, int]:
    """Bytes counted since ``before`` (a :func:`snapshot`), by kind."""
    now = snapshot()
    return {k: now[k] - before.get(k, 0) for k in KINDS}


def passes(moved: dict[str, int], state_bytes: int) -> dict[str, float]:
    """``moved`` bytes as passes over a state of ``state_bytes`` bytes, by kind, plus
    ``total`` (the sum)."""
    out = {k: moved.get(k, 0) / state_bytes if state_bytes else 0.0 for k in KINDS}
    out["total"] = sum(out[k] for k in KINDS)
    return out
