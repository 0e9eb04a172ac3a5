"""Passes over the state's bytes (ftkit.passes), counted by the code paths of a real
Checkpointer on 4 ranks / 2 virtual nodes, sync, a state of 4 float32 tensors per rank.

What each operation touches today, and so what the counters must say:

* local save: one pass, each tensor copied straight into the rank's reserved slot file with
  its checksum computed as the bytes land (``storage/slots.py``, ``capture/staging.py``);
* partner save: that, plus the send (from the mapped slot, not re-read first), the
  partner's receive straight into a slot of its own, each chunk checked right after it
  landed, in cache (the check rides on the receive: no second write, no second pass);
* XOR save (a set of 2 on 2 nodes: the parity is as large as a shard): the local write,
  one pass over the own shard that verifies it and computes its whole-file checksum and
  segment folds (``erasure.scan``), the send, the receive straight into the parity slot,
  and the parity's checksums computed in place;
* restore from the node-local level: one pass, each tensor read straight into the live
  tensor with its checksum computed as the bytes land (discovery reads headers only, of
  the own shard and of the partner copies a rank holds).

A counter missing from a path, or a pass added or removed, changes these numbers.
"""
from __future__ import annotations

import pytest
import torch

from ftkit import Checkpointer, Config, passes

from .mpi_helpers import RANK, allgather, topology

TENSOR_BYTES = 256 << 10
STATE_BYTES = 4 * TENSOR_BYTES


def _state(fill: float) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((TENSOR_BYTES // 4,), fill + RANK + i) for i in range(4)}


def _passes(fn) -> dict[str, float]:        # type: ignore[no-untyped-def]
    before = passes.snapshot()
    fn()
    got = passes.passes(passes.since(before), STATE_BYTES)
    return {k: round(v, 2) for k, v in got.items() if v}


def _measure(levels: str, **overrides) -> dict[str, dict[str, float]]:   # type: ignore[no-untyped-def]
    cfg = Config.load(async_=False, levels=levels, **overrides)
    out = {}
    with topology() as topo:
        ckpt = Checkpointer(topo, cfg)
        state = _state(1.0)
        ckpt.save(1, state)                     # first save: files, buffers, communicators
        out["save"] = _passes(lambda: ckpt.save(2, state))
        ckpt.close()
        ckpt = Checkpointer(topo, cfg)
        live = _state(0.0)
        out["restore"] = _passes(lambda: ckpt.restore(live))
        assert all(torch.equal(live[k], state[k]) for k in state)
        ckpt.close()
    return out


def test_local_save_and_restore_passes(ftkit_env) -> None:
    got = allgather(_measure("local:1"))
    for rank_got in got:
        assert rank_got["save"] == pytest.approx(
            {"write": 1, "total": 1}, abs=0.01), got
        assert rank_got["restore"] == pytest.approx({"copy": 1, "total": 1}, abs=0.01), got


def test_partner_save_and_restore_passes(ftkit_env) -> None:
    """A restore that loses nothing reads no partner copy: still one pass."""
    got = allgather(_measure("local:1,partner:1"))
    for rank_got in got:
        assert rank_got["save"] == pytest.approx(
            {"write": 1, "send": 1, "recv": 1, "total": 3},
            abs=0.01), got
        assert rank_got["restore"] == pytest.approx({"copy": 1, "total": 1}, abs=0.01), got


def test_xor_save_and_restore_passes(ftkit_env) -> None:
    """A restore that loses nothing reads no parity."""
    got = allgather(_measure("local:1,xor:1", xor_set=2))
    for rank_got in got:
        assert rank_got["save"] == pytest.approx(
            {"hash": 2, "write": 1, "send": 1, "recv": 1, "total": 5}, abs=0.02), got
        assert rank_got["restore"] == pytest.approx({"copy": 1, "total": 1}, abs=0.01), got
