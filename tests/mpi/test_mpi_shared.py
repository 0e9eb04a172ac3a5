"""Data-parallel replicas share one node-local snapshot (4 ranks, dp = 4, 2 virtual nodes;
``FTKIT_SHARE_REPLICAS=on``): each rank keeps its other tensors whole and two of the four
slices of what the replicas hold alike; a restore reads its own file and gathers the other
slices from the replicas that own them, bit-exact; a lost node's shards come back from their
partner copies and the gathering still completes; a damaged slice fails the step."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import ftkit
from ftkit import Checkpointer, Config
from ftkit.faults import flip_byte
from ftkit.recovery import sharedload
from ftkit.storage.shard import SHARED, Shard

from .mpi_helpers import RANK, WORLD, allgather, canon, diff, events, lose_node, topology

RING = [0, 2, 1, 3]          # dp = 4 on nodes [0, 0, 1, 1]: neighbours on different nodes


def _state(step: int) -> dict[str, Any]:
    """A model and its Adam state trained alike on every rank (replicas), a tensor of this
    rank's own and every RNG (rank-local); values depend on ``step``."""
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 5))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(3, 40)).sum().backward()
        opt.step()
    torch.manual_seed(1000 + RANK)
    np.random.seed(RANK)
    return {"model": model, "optim": opt, "rng": ftkit.RNGState(),
            "own": torch.full((7,), float(RANK * 100 + step))}


def _save(topo: Any, steps: list[int], **config: Any) -> dict[int, Any]:
    expected = {}
    ckpt = Checkpointer(topo, Config.load(share_replicas="on", **config))
    for step in steps:
        state = _state(step)
        expected[step] = canon(state)
        ckpt.save(step, state)
    ckpt.close()
    return expected


def _restore(topo: Any, **config: Any) -> tuple[int, Any]:
    state = _state(99)                              # other values everywhere
    ckpt = Checkpointer(topo, Config.load(share_replicas="on", **config))
    step = ckpt.restore(state)
    ckpt.close()
    return step, canon(state)


@pytest.mark.parametrize("async_", [True, False])
def test_each_replica_keeps_two_slices_and_the_restore_gathers_the_rest(ftkit_env, async_):
    """Step 2's file of every rank: format 2, its ring position, the own tensor and the RNG
    whole, and half of the replicated bytes (2 of 4 slices); restored bit-exact."""
    with topology() as topo:
        expected = _save(topo, [1, 2], async_=async_)
        with Shard.open(ftkit_env.step_dir(topo.node, 2) / f"rank-{RANK}.ftk") as shard:
            share, tensors = shard.header["share"], shard.tensors
            assert shard.header["format"] == SHARED
        step, got = _restore(topo, async_=async_)
    assert share["position"] == RING.index(RANK) and share["parts"] == 4
    whole = [t["path"] for t in tensors[:len(share["whole"])]]
    assert "own" in whole and all(p == "own" or p.startswith("rng/") for p in whole)
    replicated = sum(d["nbytes"] for d in share["replicated"])
    kept = sum(t["nbytes"] for t in tensors[len(whole):])
    assert abs(kept - replicated / 2) < 2 * 64 * 2, (kept, replicated)
    assert allgather(step) == [2] * 4
    assert allgather(diff(expected[2], got)) == [[]] * 4


def test_a_lost_node_comes_back_from_the_copies_and_the_replicas(ftkit_env):
    """``local:1,partner:1``: node 1 lost; ranks 2 and 3 load their shared shards from the
    partner copies on node 0, then every rank gathers the slices it does not keep:
    bit-exact, the restore event says where the lost shards came from."""
    with topology() as topo:
        expected = _save(topo, [1, 2], levels="local:1,partner:1")
        lose_node(ftkit_env, 1)
        step, got = _restore(topo, levels="local:1,partner:1")
    assert allgather(step) == [2] * 4
    assert allgather(diff(expected[2], got)) == [[]] * 4
    restore = [e for e in events(ftkit_env.events_path) if e["event"] == "restore"][-1]
    assert set(restore["loaded_from"]) == {"2", "3"}, restore


def test_a_damaged_slice_fails_the_step_everywhere(ftkit_env):
    """A flipped byte in a slice rank 2 keeps (and would send): the step is refused on
    every rank and step 1 is restored, bit-exact."""
    with topology() as topo:
        expected = _save(topo, [1, 2])
        WORLD.Barrier()
        if RANK == 2:
            path = ftkit_env.step_dir(topo.node, 2) / "rank-2.ftk"
            with Shard.open(path) as shard:
                last = shard.tensors[-1]
            flip_byte(path, last["offset"] + last["nbytes"] // 2)
        WORLD.Barrier()
        step, got = _restore(topo)
    assert allgather(step) == [1] * 4
    assert allgather(diff(expected[1], got)) == [[]] * 4


def test_without_a_ring_across_nodes_every_shard_stays_whole(ftkit_env, caplog):
    """Three of the four replicas on one node: no ring whose neighbours sit on different
    nodes, so every rank writes its whole shard (format 1) and rank 0 says why once."""
    with topology(ranks_per_node=3) as topo:
        with caplog.at_level("WARNING", logger="ftkit.storage.replicas"):
            _save(topo, [1])
        with Shard.open(ftkit_env.step_dir(topo.node, 1) / f"rank-{RANK}.ftk") as shard:
            fmt = shard.header["format"]
    assert fmt == 1
    said = [r.getMessage() for r in caplog.records if "FTKIT_SHARE_REPLICAS" in r.getMessage()]
    assert len(said) == (1 if RANK == 0 else 0), said


def test_a_slice_that_arrives_damaged_fails_the_step_everywhere(ftkit_env, monkeypatch):
    """Rank 0 announces a wrong checksum for the slice it owns of step 2 (as if its bytes
    changed on the way): the two replicas that receive that slice catch it as it lands,
    step 2 is refused on every rank, naming the slice and the sender, and step 1 is
    restored bit-exact."""
    real = sharedload.share_info

    def lying(shard: Any) -> Any:
        info = real(shard)
        if RANK == 0 and info is not None and shard.header["step"] == 2:
            for sums in info["sums"].values():
                sums[:] = ["xxh3-64:" + "0" * 16] * len(sums)
        return info
    monkeypatch.setattr(sharedload, "share_info", lying)
    with topology() as topo:
        expected = _save(topo, [1, 2])
        step, got = _restore(topo)
    assert allgather(step) == [1] * 4
    assert allgather(diff(expected[1], got)) == [[]] * 4
    skips = [e for e in events(ftkit_env.events_path) if e["event"] == "restore-skip"]
    assert len(skips) == 1 and "sent by rank 0 does not match its checksum" in str(skips), skips
