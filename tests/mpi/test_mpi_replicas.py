"""Which tensors the data-parallel replicas hold alike (4 ranks): every replica gets the same
answer, rank-local and differing tensors stay whole, the ones that differ are named once."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import ftkit
from ftkit.capture.flatten import flatten
from ftkit.comm.dist import DistComm
from ftkit.storage.replicas import classify

from .mpi_helpers import RANK, allgather, topology


def _trained(seed: int) -> dict[str, object]:
    """A model and its Adam state after one step on the same batch: alike on every rank."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt}


def _classify(topo, state):
    tree, leaves = flatten(state)
    dc = DistComm(topo.dp_group, 30.0)
    try:
        got = classify(dc, RANK, tree, leaves, step=3)
    finally:
        dc.comm.Free()
    return ({leaves[i].path for i in got.replicated},
            {leaves[i].path: why for i, why in got.whole.items()})


@pytest.mark.parametrize("tp", [1, 2])
def test_replicas_are_found_and_what_differs_is_named(caplog, tp):
    """dp = 4 (tp 1) or dp2 x tp2: the model, its Adam state, a NumPy array and a tensor of
    the tp shard are replicas; the RNG state is rank-local; a per-rank tensor and one that
    depends on the DP index (a ZeRO-style shard) differ: whole, named in one warning by the
    first rank of each DP group, with the ranks and their checksums."""
    with topology(tp=tp) as topo:
        dp_idx = topo.coords.dp
        state = {**_trained(0), "np": np.arange(5), "rng": ftkit.RNGState(),
                 "tp_part": torch.full((3,), float(topo.coords.tp)),
                 "per": torch.full((3,), float(RANK)),
                 "zero": torch.full((2,), float(dp_idx))}
        with caplog.at_level(logging.WARNING, logger="ftkit.storage.replicas"):
            replicated, whole = _classify(topo, state)
    assert replicated == {"model/weight", "model/bias", "np", "tp_part",
                          "optim/state/0/exp_avg", "optim/state/0/exp_avg_sq",
                          "optim/state/0/step", "optim/state/1/exp_avg",
                          "optim/state/1/exp_avg_sq", "optim/state/1/step"}, replicated
    assert set(whole) == {"per", "zero"} | {p for p in whole if p.startswith("rng/")}
    assert all(whole[p] == "rank-local" for p in whole if p.startswith("rng/"))
    group = [r for r in range(4) if r % tp == RANK % tp]
    assert whole["per"].count("ranks [") == len(group)     # every replica its own bytes
    assert f"ranks [{group[0]}]: per float32 [3] xxh3-64:" in whole["per"]
    every = allgather((replicated, whole))
    assert all(every[r] == (replicated, whole) for r in group)   # one answer per DP group
    warned = [r.getMessage() for r in caplog.records]
    if topo.coords.dp == 0:
        assert len(warned) == 2 and "step 3: per differs" in warned[0] \
            and "zero differs" in warned[1], warned
    else:
        assert warned == []


def test_a_tensor_not_every_replica_holds_stays_whole():
    """Rank 3's state has another shape for ``w`` and one more tensor: ``w`` is whole on
    every rank, naming rank 3's shape; what all hold alike is still replicated."""
    with topology() as topo:
        w = torch.zeros(5 if RANK == 3 else 4)
        state = {"a": torch.ones(2), "w": w} | ({"extra": torch.ones(1)} if RANK == 3 else {})
        replicated, whole = _classify(topo, state)
    assert replicated == {"a"}
    assert "ranks [3]: w float32 [5]" in whole["w"] and "ranks [0, 1, 2]: w float32 [4]" \
        in whole["w"]
    if RANK == 3:
        assert "rank-local or no such tensor" in whole["extra"]
