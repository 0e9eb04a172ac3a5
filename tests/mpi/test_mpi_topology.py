"""Topology on 4 ranks: DP/TP/PP groups, shape errors, virtual nodes, partner map."""
from __future__ import annotations

import pytest

from ftkit import ConfigError
from ftkit.comm.topology import Topology

from .mpi_helpers import RANK, SIZE, WORLD, allgather, same_on_all_ranks, topology


def expected_grid(world: int, tp: int, pp: int) -> dict[int, tuple[int, int, int]]:
    """(dp_idx, tp_idx, pp_idx) of every rank by enumerating the grid: tp fastest, then dp,
    then pp (Megatron's order), independently of ftkit's formula."""
    dp = world // (tp * pp)
    grid, rank = {}, 0
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                grid[rank] = (d, t, p)
                rank += 1
    return grid


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)])
def test_groups_follow_tp_then_dp_then_pp(tp, pp):
    grid = expected_grid(SIZE, tp, pp)
    dp = SIZE // (tp * pp)
    with topology(tp=tp, pp=pp, ranks_per_node=2) as topo:
        mine = {
            "shape": (topo.dp, topo.tp, topo.pp),
            "coords": (topo.coords.dp, topo.coords.tp, topo.coords.pp),
            "tp_group": topo.tp_group.allgather(RANK),
            "dp_group": topo.dp_group.allgather(RANK),
            "pp_group": topo.pp_group.allgather(RANK),
            "group_ranks": (topo.tp_group.Get_rank(), topo.dp_group.Get_rank(),
                            topo.pp_group.Get_rank()),
        }
    everyone = allgather(mine)
    for r, got in enumerate(everyone):
        d, t, p = grid[r]
        want = {
            "shape": (dp, tp, pp),
            "coords": (d, t, p),
            "tp_group": [s for s, c in grid.items() if c[0] == d and c[2] == p],
            "dp_group": [s for s, c in grid.items() if c[1] == t and c[2] == p],
            "pp_group": [s for s, c in grid.items() if c[0] == d and c[1] == t],
            "group_ranks": (t, d, p),
        }
        assert got == want, f"rank {r} (tp={tp}, pp={pp})"
    # the concrete Megatron layout for tp=2, pp=2 on 4 ranks, spelled out
    if (tp, pp) == (2, 2):
        assert [e["tp_group"] for e in everyone] == [[0, 1], [0, 1], [2, 3], [2, 3]]
        assert [e["pp_group"] for e in everyone] == [[0, 2], [1, 3], [0, 2], [1, 3]]
        assert [e["dp_group"] for e in everyone] == [[0], [1], [2], [3]]


@pytest.mark.parametrize(("tp", "pp", "product"), [(3, 1, 3), (1, 3, 3), (2, 3, 6), (8, 1, 8)])
def test_world_not_divisible_is_config_error_on_every_rank(tp, pp, product):
    with pytest.raises(ConfigError) as info:
        Topology.create(WORLD, tp=tp, pp=pp, ranks_per_node=2)
    msg = same_on_all_ranks(str(info.value), "error message")
    assert f"world size {SIZE}" in msg
    assert f"{tp}*{pp}" in msg and f"= {product}" in msg


@pytest.mark.parametrize(("tp", "pp"), [(0, 1), (1, 0), (-2, 1)])
def test_non_positive_shape_is_config_error(tp, pp):
    with pytest.raises(ConfigError, match=f"tp={tp} pp={pp}"):
        Topology.create(WORLD, tp=tp, pp=pp, ranks_per_node=2)
    allgather(None)   # every rank got here


@pytest.mark.parametrize("source", ["argument", "environment"])
def test_virtual_nodes(source, monkeypatch):
    if source == "argument":
        monkeypatch.delenv("FTKIT_RANKS_PER_NODE", raising=False)
        kwargs = {"ranks_per_node": 2}
    else:
        monkeypatch.setenv("FTKIT_RANKS_PER_NODE", "2")
        kwargs = {}
    with topology(**kwargs) as topo:
        mine = (topo.rank_node, topo.node, topo.node_rank, topo.is_node_leader,
                topo.node_comm.allgather(RANK), topo.nodes, topo.ranks_on(topo.node),
                topo.describe()["nodes"])
    everyone = allgather(mine)
    assert everyone == [
        ([0, 0, 1, 1], 0, 0, True, [0, 1], [0, 1], [0, 1], 2),
        ([0, 0, 1, 1], 0, 1, False, [0, 1], [0, 1], [0, 1], 2),
        ([0, 0, 1, 1], 1, 0, True, [2, 3], [0, 1], [2, 3], 2),
        ([0, 0, 1, 1], 1, 1, False, [2, 3], [0, 1], [2, 3], 2),
    ]


def test_real_nodes_one_host(monkeypatch):
    """Without FTKIT_RANKS_PER_NODE the nodes come from COMM_TYPE_SHARED: one host here."""
    monkeypatch.delenv("FTKIT_RANKS_PER_NODE", raising=False)
    with topology() as topo:
        mine = (topo.rank_node, topo.node, topo.node_rank, topo.node_comm.Get_size())
    assert allgather(mine) == [([0, 0, 0, 0], 0, r, 4) for r in range(4)]


def test_bad_ranks_per_node_environment(monkeypatch):
    monkeypatch.setenv("FTKIT_RANKS_PER_NODE", "two")
    with pytest.raises(ConfigError, match="FTKIT_RANKS_PER_NODE"):
        Topology.create(WORLD)
    allgather(None)


@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_partner_map_is_a_permutation_across_nodes(ranks_per_node):
    with topology(ranks_per_node=ranks_per_node) as topo:
        partners = topo.partner_map()
        rank_node = topo.rank_node
    partners = same_on_all_ranks(partners, "partner map")
    assert sorted(partners) == list(range(SIZE)), f"not a permutation: {partners}"
    for r, p in enumerate(partners):
        assert rank_node[p] != rank_node[r], f"rank {r}'s partner {p} is on its node"


@pytest.mark.parametrize(("ranks_per_node", "tp", "ring"),
                         [(2, 1, [0, 2, 1, 3]), (1, 2, "tp"), (2, 2, "tp"), (3, 1, None),
                          (4, 2, None)])
def test_dp_ring_of_a_rank(ranks_per_node, tp, ring):
    """Pure DP on 2 nodes of 2: one ring alternating the nodes, the same on every rank;
    dp2 x tp2 (one or two ranks per node): the ring of the rank's DP pair, which spans 2
    nodes; 3 of 4 replicas on one node, or every DP pair on one node: none (whole shards)."""
    with topology(ranks_per_node=ranks_per_node, tp=tp) as topo:
        got = topo.dp_ring()
    assert got == ([RANK % 2, RANK % 2 + 2] if ring == "tp" else ring)


def test_partner_map_uneven_nodes_still_on_other_node():
    """3 + 1 ranks: a permutation is impossible, but every partner is on the other node."""
    with topology(ranks_per_node=3) as topo:
        partners = topo.partner_map()
        rank_node = topo.rank_node
    partners = same_on_all_ranks(partners, "partner map")
    assert rank_node == [0, 0, 0, 1]
    assert all(rank_node[p] != rank_node[r] for r, p in enumerate(partners)), partners


def test_partner_map_on_one_node_is_config_error():
    with topology(ranks_per_node=4) as topo:
        assert topo.rank_node == [0, 0, 0, 0]
        with pytest.raises(ConfigError) as info:
            topo.partner_map()
    msg = same_on_all_ranks(str(info.value), "error message")
    assert "different node" in msg and "1 node" in msg
