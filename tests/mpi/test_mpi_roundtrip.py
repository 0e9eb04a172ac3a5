"""Save and restore through the real Checkpointer on 4 ranks (2 virtual nodes), bit-exact."""
from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
import torch

import ftkit
from ftkit import Checkpointer, Config

from .mpi_helpers import (
    RANK,
    allgather,
    canon,
    diff,
    mutate,
    node_listing,
    rich_state,
    rng_draws,
    topology,
)


@pytest.mark.parametrize("async_", ["0", "1"], ids=["sync", "async"])
def test_roundtrip_every_kind_of_leaf_is_bit_exact(ftkit_env, monkeypatch, async_):
    monkeypatch.setenv("FTKIT_ASYNC", async_)
    state = rich_state(RANK, seed=1)
    expected = canon(state)
    # the states really are rank specific, so a mix-up between ranks would be caught
    assert len(set(allgather(hashlib.sha256(repr(expected).encode()).hexdigest()))) == 4

    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load())
        is_async = ckpt._async
        ckpt.save(3, state)
        draws = rng_draws()          # what the generators give right after the save
        ckpt.wait_staged()           # mutate() changes parameters in place
        mutate(state, RANK)          # while (async) the checkpoint is still being written
        changed = diff(expected, canon(state))
        ckpt.close()

        ckpt2 = Checkpointer(topo, Config.load())
        step = ckpt2.restore(state)
        got = canon(state)
        redraws = rng_draws()
        # a fresh process: new objects, a model with other weights, an Adam that never stepped
        fresh = rich_state(RANK, seed=7)
        fresh["optim"].state.clear()
        step_fresh = ckpt2.restore(fresh)
        got_fresh = canon(fresh)
        ckpt2.close()

    everyone = allgather({"async": is_async, "changed": bool(changed), "step": step,
                          "step_fresh": step_fresh, "problems": diff(expected, got),
                          "problems_fresh": diff(expected, got_fresh),
                          "same_draws": draws == redraws})
    want = {"async": async_ == "1", "changed": True, "step": 3, "step_fresh": 3,
            "problems": [], "problems_fresh": [], "same_draws": True}
    assert everyone == [want] * 4, everyone
    assert state["rank"] == RANK and fresh["rank"] == RANK
    assert isinstance(fresh["nested"]["list"][1], tuple)
    assert fresh["tensors"]["bfloat16"].dtype == torch.bfloat16


def test_roundtrip_shards_sit_on_their_own_node(ftkit_env):
    """Rank r's shard lands in node-(r//2)/step-s/rank-r.ftk (FTKIT_RANKS_PER_NODE=2)."""
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=False))
        ckpt.save(1, {"x": torch.full((8,), float(RANK))})
        ckpt.close()
    everyone = allgather(node_listing(ftkit_env.step_dir(RANK // 2, 1)))
    node0 = ["COMMITTED", "rank-0.ftk", "rank-1.ftk"]
    node1 = ["COMMITTED", "rank-2.ftk", "rank-3.ftk"]
    assert everyone == [node0, node0, node1, node1], everyone


def test_roundtrip_leaves_whose_paths_print_alike(ftkit_env):
    """Regression: staging buffers were keyed by the printed path, so {'a/b': t1,
    'a': {'b': t2}} or {1: t1, '1': t2} shared one buffer and t1 was saved as t2."""
    state = {"a/b": torch.full((4,), 1.0 + RANK), "a": {"b": torch.full((4,), -2.0 - RANK)},
             "k": {1: torch.full((2,), 5.0), "1": torch.full((2,), 7.0)}}
    expected = canon(state)
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=False))
        ckpt.save(1, state)
        ckpt.close()
        for t in (state["a/b"], state["a"]["b"], state["k"][1], state["k"]["1"]):
            t.zero_()
        ckpt2 = Checkpointer(topo, Config.load(async_=False))
        step = ckpt2.restore(state)
        ckpt2.close()
    everyone = allgather((step, diff(expected, canon(state))))
    assert everyone == [(1, [])] * 4, everyone


def test_rng_state_round_trip_continues_the_streams(ftkit_env):
    """RNGState alone: after restore, Python/NumPy/torch draw exactly what they drew after
    the save, different on every rank."""
    state = {"rng": ftkit.RNGState()}
    random.seed(RANK)
    np.random.seed(RANK + 10)
    torch.manual_seed(RANK + 20)
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load())
        ckpt.save(2, state)
        ckpt.wait()
        first = rng_draws()
        rng_draws()
        ckpt.close()
        ckpt2 = Checkpointer(topo, Config.load())
        step = ckpt2.restore(state)
        again = rng_draws()
        ckpt2.close()
    everyone = allgather((step, again == first, repr(first)))
    assert [(s, same) for s, same, _ in everyone] == [(2, True)] * 4, everyone
    assert len({d for _, _, d in everyone}) == 4, "the streams should differ between ranks"
