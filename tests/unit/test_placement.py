"""ftkit.comm.placement: partner pairs and erasure sets on distinct nodes (pure functions)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftkit.comm.placement import dp_rings, erasure_sets, partner_map, set_of
from ftkit.comm.topology import check_shape, coords_of, number_groups, virtual_nodes
from ftkit.errors import ConfigError

Shape = tuple[list[int], list[tuple[int, int]] | None, str]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _shard_of(world: int, tp: int, pp: int) -> list[tuple[int, int]]:
    dp = check_shape(world, tp, pp)
    return [(c.tp, c.pp) for c in (coords_of(r, dp, tp, pp) for r in range(world))]


def _even_shapes() -> Iterator[Shape]:
    """Every (ranks per node 1..4) x (nodes 2..9) x (tp, pp) split of the world."""
    for rpn in range(1, 5):
        for nodes in range(2, 10):
            world = rpn * nodes
            rank_node = virtual_nodes(world, rpn)
            yield rank_node, None, f"rpn={rpn} nodes={nodes}"
            for tp in _divisors(world):
                for pp in _divisors(world // tp):
                    yield (rank_node, _shard_of(world, tp, pp),
                           f"rpn={rpn} nodes={nodes} tp={tp} pp={pp}")


def _uneven_shapes() -> Iterator[Shape]:
    """Consecutive blocks of rpn ranks with a short last node (FTKIT_RANKS_PER_NODE with a
    world size that is not a multiple), plus hand-made uneven maps."""
    for rpn in range(2, 5):
        for nodes in range(2, 10):
            for short in range(1, rpn):
                world = rpn * (nodes - 1) + short
                rank_node = virtual_nodes(world, rpn)
                yield rank_node, None, f"rpn={rpn} world={world}"
                for tp in _divisors(world):
                    for pp in _divisors(world // tp):
                        yield (rank_node, _shard_of(world, tp, pp),
                               f"rpn={rpn} world={world} tp={tp} pp={pp}")
    yield [3, 3, 3, 7, 1, 1], None, "sparse node ids"
    yield [0, 1, 0, 1, 2, 0], None, "interleaved"


EVEN = list(_even_shapes())
UNEVEN = list(_uneven_shapes())


def _replicas_on_distinct_nodes(rank_node: Sequence[int], shard_of: Sequence[tuple[int, int]],
                                size: int) -> bool:
    groups: dict[tuple[int, int], list[int]] = {}
    for r, key in enumerate(shard_of):
        groups.setdefault(key, []).append(r)
    return all(len({rank_node[r] for r in g}) == len(g) >= size for g in groups.values())


def _check_partners(rank_node: Sequence[int], partners: Sequence[int], label: str) -> None:
    assert len(partners) == len(rank_node), label
    for r, q in enumerate(partners):
        assert 0 <= q < len(rank_node), (label, r, q)
        assert rank_node[q] != rank_node[r], f"{label}: rank {r} partnered on its own node"


def _expected_sizes(groups: list[int], size: int, minimum: int) -> Counter[int]:
    """Set sizes when each group of g ranks is cut into sets of `size`, a remainder smaller
    than `minimum` joining the last set."""
    out: Counter[int] = Counter()
    for g in groups:
        q, rem = divmod(g, size)
        sizes = [size] * q
        if rem >= minimum:
            sizes.append(rem)
        elif rem:
            sizes[-1] += rem
        out.update(sizes)
    return out


def _groups(rank_node: Sequence[int], shard_of: Sequence[tuple[int, int]] | None,
            size: int) -> list[int]:
    """Group lengths for equal ranks per node: DP replica groups if they qualify, else the
    SCR columns (one per node-local index, each as long as there are nodes)."""
    if shard_of is not None and _replicas_on_distinct_nodes(rank_node, shard_of, size):
        return list(Counter(shard_of).values())
    per_node = Counter(rank_node)
    return [len(per_node)] * next(iter(per_node.values()))


def _check_sets(rank_node: Sequence[int], sets: list[list[int]], size: int, minimum: int,
                label: str, groups: list[int] | None) -> None:
    flat = [r for s in sets for r in s]
    assert sorted(flat) == list(range(len(rank_node))), f"{label}: not a partition {sets}"
    for s in sets:
        assert len({rank_node[r] for r in s}) == len(s), f"{label}: set {s} shares a node"
        assert minimum <= len(s) < size + minimum, f"{label}: set {s} (size {size})"
    if groups is not None:
        assert Counter(len(s) for s in sets) == _expected_sizes(groups, size, minimum), label
    for sid, s in enumerate(sets):
        for i, r in enumerate(s):
            assert set_of(sets, r) == (sid, i)


# ---------------------------------------------------------------------------- partner map
@pytest.mark.parametrize("shapes", [EVEN, UNEVEN], ids=["even", "uneven"])
def test_partner_on_another_node(shapes: list[Shape]) -> None:
    for rank_node, shard_of, label in shapes:
        _check_partners(rank_node, partner_map(rank_node, shard_of), label)


def test_partner_map_is_a_permutation_when_nodes_are_even() -> None:
    for rank_node, shard_of, label in EVEN:
        partners = partner_map(rank_node, shard_of)
        assert sorted(partners) == list(range(len(rank_node))), label
        # every node stores exactly as many copies as it has ranks
        stored = Counter(rank_node[q] for q in partners)
        assert stored == Counter(rank_node), label


def test_partner_is_a_dp_replica_when_replicas_span_nodes() -> None:
    used = 0
    for rank_node, shard_of, label in EVEN + UNEVEN:
        if shard_of is None or not _replicas_on_distinct_nodes(rank_node, shard_of, 2):
            continue
        used += 1
        partners = partner_map(rank_node, shard_of)
        for r, q in enumerate(partners):
            assert shard_of[q] == shard_of[r], f"{label}: rank {r} -> {q}"
            assert q != r
    assert used > 20      # the preference is actually exercised


def test_partner_columns_follow_scr_layout() -> None:
    # 3 nodes x 2 ranks, no shard info: rank i's copy goes to the same local index on the
    # next node (ring)
    assert partner_map([0, 0, 1, 1, 2, 2]) == [2, 3, 4, 5, 0, 1]
    # tp=2 spans a node, dp=3: the DP replica of rank r is r +- 2
    assert partner_map([0, 0, 1, 1, 2, 2], _shard_of(6, 2, 1)) == [2, 3, 4, 5, 0, 1]
    # a lone rank of a short node goes to the next node
    partners = partner_map([0, 0, 0, 1])
    assert partners[1] == 3 and partners[2] == 3 and partners[3] == 0


def test_partner_map_not_dp_when_replicas_share_a_node() -> None:
    # tp=1 dp=2 pp=2 on 2 nodes of 2: dp replicas (0,1) and (2,3) share a node -> columns
    rank_node, shard_of = [0, 0, 1, 1], _shard_of(4, 1, 2)
    partners = partner_map(rank_node, shard_of)
    _check_partners(rank_node, partners, "dp on one node")
    assert partners == [2, 3, 0, 1]


@pytest.mark.parametrize("rank_node", [[0], [0, 0, 0, 0], [5, 5]])
def test_partner_on_one_node_is_a_config_error(rank_node: list[int]) -> None:
    with pytest.raises(ConfigError) as info:
        partner_map(rank_node)
    msg = str(info.value)
    assert f"all {len(rank_node)} ranks are on 1 node" in msg
    assert "FTKIT_RANKS_PER_NODE" in msg


# ---------------------------------------------------------------------------- erasure sets
def _sizes(nodes: int) -> Iterator[tuple[int, int]]:
    for size in range(2, nodes + 1):
        for minimum in range(2, size + 1):
            yield size, minimum


def test_erasure_sets_even_nodes() -> None:
    for rank_node, shard_of, label in EVEN:
        nodes = len(set(rank_node))
        for size, minimum in _sizes(nodes):
            sets = erasure_sets(rank_node, size, minimum=minimum, shard_of=shard_of)
            _check_sets(rank_node, sets, size, minimum, f"{label} size={size} min={minimum}",
                        _groups(rank_node, shard_of, size))
            if shard_of is not None and _replicas_on_distinct_nodes(rank_node, shard_of, size):
                for s in sets:
                    assert len({shard_of[r] for r in s}) == 1, f"{label}: {s} mixes shards"


def test_erasure_sets_uneven_nodes() -> None:
    built = 0
    for rank_node, shard_of, label in UNEVEN:
        nodes = len(set(rank_node))
        for size, minimum in _sizes(nodes):
            try:
                sets = erasure_sets(rank_node, size, minimum=minimum, shard_of=shard_of)
            except ConfigError as exc:
                assert str(minimum) in str(exc) and "distinct nodes" in str(exc), label
                continue
            built += 1
            _check_sets(rank_node, sets, size, minimum, f"{label} size={size} min={minimum}",
                        None)
    assert built > 100


def test_erasure_remainder_is_merged_into_the_last_set() -> None:
    # one column of 5 nodes, size 4: the remainder of 1 joins the last set
    assert erasure_sets(list(range(5)), 4) == [[0, 1, 2, 3, 4]]
    # 6 nodes, size 4, minimum 2: the remainder of 2 is its own set
    assert erasure_sets(list(range(6)), 4) == [[0, 1, 2, 3], [4, 5]]
    # ... but with minimum 3 (RS with 2 parity) it is merged
    assert erasure_sets(list(range(6)), 4, minimum=3) == [[0, 1, 2, 3, 4, 5]]
    # 2 ranks per node on 4 nodes: the SCR columns
    assert erasure_sets([0, 0, 1, 1, 2, 2, 3, 3], 4) == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize("world,rpn,size", [(4, 2, 3), (8, 4, 4), (6, 3, 3), (3, 3, 2)])
def test_erasure_sets_too_few_nodes_names_numbers(world: int, rpn: int, size: int) -> None:
    rank_node = virtual_nodes(world, rpn)
    nodes = len(set(rank_node))
    with pytest.raises(ConfigError) as info:
        erasure_sets(rank_node, size, what="xor")
    msg = str(info.value)
    assert f"xor set size {size}" in msg
    assert f"at least {size} nodes" in msg
    assert f"{world} ranks on {nodes} node" in msg


def test_set_of_unknown_rank() -> None:
    with pytest.raises(KeyError):
        set_of([[0, 1], [2, 3]], 4)


@pytest.mark.parametrize("rank_node,size", [
    ([0, 0, 1, 2], 2),                          # srun -n 4 -N 3: {0,2},{1,3}
    ([0, 0, 0, 1, 1, 2], 2),                    # {0,3},{1,4},{2,5}
    ([0, 0, 0, 1, 1, 2, 2, 3, 3], 4),           # srun -n 9 -N 4, default FTKIT_XOR_SET=4
])
def test_erasure_sets_feasible_uneven_layout(rank_node: list[int], size: int) -> None:
    sets = erasure_sets(rank_node, size, what="xor")
    _check_sets(rank_node, sets, size, 2, str(rank_node), None)


# ---------------------------------------------------------------------------- hypothesis
rank_nodes = st.lists(st.integers(0, 6), min_size=1, max_size=24)


@settings(max_examples=300, deadline=None)
@given(rank_node=rank_nodes)
def test_partner_map_random(rank_node: list[int]) -> None:
    if len(set(rank_node)) < 2:
        with pytest.raises(ConfigError):
            partner_map(rank_node)
        return
    _check_partners(rank_node, partner_map(rank_node), str(rank_node))


@settings(max_examples=300, deadline=None)
@given(rank_node=rank_nodes, size=st.integers(2, 5), extra=st.integers(0, 3))
def test_erasure_sets_random(rank_node: list[int], size: int, extra: int) -> None:
    minimum = max(2, size - extra)
    nodes = len(set(rank_node))
    even = len(set(Counter(rank_node).values())) == 1
    if nodes < size:
        with pytest.raises(ConfigError, match=f"at least {size} nodes"):
            erasure_sets(rank_node, size, minimum=minimum)
        return
    try:
        sets = erasure_sets(rank_node, size, minimum=minimum)
    except ConfigError:
        assert not even, "equal ranks per node on enough nodes must always work"
        return
    _check_sets(rank_node, sets, size, minimum, str(rank_node),
                _groups(rank_node, None, size) if even else None)


@settings(max_examples=200, deadline=None)
@given(nodes=st.integers(2, 8), rpn=st.integers(1, 4), tp=st.integers(1, 4),
       pp=st.integers(1, 3), size=st.integers(2, 4))
def test_topology_shapes_random(nodes: int, rpn: int, tp: int, pp: int, size: int) -> None:
    world = nodes * rpn
    if world % (tp * pp):
        return
    rank_node, shard_of = virtual_nodes(world, rpn), _shard_of(world, tp, pp)
    partners = partner_map(rank_node, shard_of)
    _check_partners(rank_node, partners, "topology")
    assert sorted(partners) == list(range(world))
    if _replicas_on_distinct_nodes(rank_node, shard_of, 2):
        assert all(shard_of[q] == shard_of[r] for r, q in enumerate(partners))
    if nodes >= size:
        sets = erasure_sets(rank_node, size, shard_of=shard_of)
        _check_sets(rank_node, sets, size, 2, "topology", _groups(rank_node, shard_of, size))


def test_nodes_are_numbered_in_the_order_of_their_lowest_rank() -> None:
    # node leaders' ranks (COMM_TYPE_SHARED) and host names number nodes alike
    assert number_groups([0, 0, 2, 2, 4]) == [0, 0, 1, 1, 2]
    assert number_groups([0, 1, 0, 1, 4]) == [0, 1, 0, 1, 2]
    assert number_groups(["n3", "n1", "n3", "n1"]) == [0, 1, 0, 1]


def test_dp_rings_put_neighbours_on_different_nodes():
    """Pure data parallel, 2 ranks per node: one ring alternating the nodes; dp2 x tp2 with
    one rank of each replica per node: a ring per tp index; a shard whose replicas share
    one node, or a single replica, has no ring."""
    assert dp_rings([0, 0, 1, 1], [(0, 0)] * 4) == [[0, 2, 1, 3]]
    tp2 = [coords_of(r, 2, 2, 1) for r in range(4)]           # ranks 0,1: dp 0; 2,3: dp 1
    assert dp_rings([0, 0, 1, 1], [(c.tp, c.pp) for c in tp2]) == [[0, 2], [1, 3]]
    assert dp_rings([0, 0, 0, 1], [(0, 0)] * 4) is None       # node 0 holds 3 of 4
    assert dp_rings([0, 1], [(0, 0), (1, 0)]) is None          # dp = 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=2, max_size=24))
def test_dp_rings_exist_exactly_when_no_node_holds_more_than_half(nodes):
    """One shard, replicas on the given nodes: a ring whose neighbours (the first and the
    last too) are on different nodes, holding every replica once, exists iff no node holds
    more than half of them."""
    rings = dp_rings(nodes, [(0, 0)] * len(nodes))
    fits = max(Counter(nodes).values()) <= len(nodes) // 2
    assert (rings is not None) == fits
    if rings is not None:
        [ring] = rings
        assert sorted(ring) == list(range(len(nodes)))
        assert all(nodes[ring[i]] != nodes[ring[i - 1]] for i in range(len(ring)))
