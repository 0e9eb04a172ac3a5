"""Where redundancy goes: partner pairs and erasure sets on *different* nodes (SCR's rule).

Pure functions of the rank -> node map and the (tp, pp) coordinates, shared by
:class:`~ftkit.comm.topology.Topology`, the storage levels and ``ftkit advise``.

Preference: ranks that hold the same (tp, pp) shard (DP replicas) form the groups when every
such group spans enough distinct nodes; otherwise SCR's layout is used: the ranks with the same
node-local index on consecutive nodes.
"""
from __future__ import annotations

from collections.abc import Sequence

from ftkit.errors import ConfigError


def _columns(rank_node: Sequence[int]) -> list[list[int]]:
    """SCR layout: column j = the j-th rank of every node, nodes in ascending order."""
    nodes = sorted(set(rank_node))
    members = {n: [r for r, m in enumerate(rank_node) if m == n] for n in nodes}
    width = max(len(v) for v in members.values())
    return [[members[n][j] for n in nodes if j < len(members[n])] for j in range(width)]


def _replica_groups(rank_node: Sequence[int], shard_of: Sequence[tuple[int, int]] | None,
                    size: int) -> list[list[int]] | None:
    """Groups of ranks holding the same (tp, pp) shard, if each spans >= size distinct
    nodes with one rank per node; None otherwise."""
    if shard_of is None:
        return None
    groups: dict[tuple[int, int], list[int]] = {}
    for rank, key in enumerate(shard_of):
        groups.setdefault(tuple(key), []).append(rank)  # type: ignore[arg-type]
    out = []
    for ranks in groups.values():
        nodes = [rank_node[r] for r in ranks]
        if len(set(nodes)) != len(nodes) or len(nodes) < size:
            return None
        out.append(sorted(ranks, key=lambda r: (rank_node[r], r)))
    return sorted(out)


def partner_map(rank_node: Sequence[int],
                shard_of: Sequence[tuple[int, int]] | None = None) -> list[int]:
    """``partners[r]`` is the rank whose node stores rank r's copy; always another node.

    Within each group (DP replicas, or SCR columns) rank i's copy goes to member i+1 (ring).
    Raises ConfigError when there is only one node.
    """
    nodes = sorted(set(rank_node))
    if len(nodes) < 2:
        raise ConfigError(f"a partner on a different node is impossible: all {len(rank_node)} "
                          f"ranks are on 1 node (set FTKIT_RANKS_PER_NODE or use >= 2 nodes)")
    groups = _replica_groups(rank_node, shard_of, 2) or _columns(rank_node)
    partners = [-1] * len(rank_node)
    for group in groups:
        if len(group) == 1:   # a lone rank (uneven nodes): ring over the next node's ranks
            rank = group[0]
            nxt = nodes[(nodes.index(rank_node[rank]) + 1) % len(nodes)]
            partners[rank] = min(r for r, n in enumerate(rank_node) if n == nxt)
            continue
        for i, rank in enumerate(group):
            partners[rank] = group[(i + 1) % len(group)]
    return partners


def erasure_sets(rank_node: Sequence[int], size: int, *, minimum: int = 2,
                 shard_of: Sequence[tuple[int, int]] | None = None,
                 what: str = "erasure") -> list[list[int]]:
    """Split ranks into sets of ``size`` members on distinct nodes (the last set of a group
    absorbs a remainder smaller than ``minimum``). Raises ConfigError when the node count
    cannot support the set size."""
    nodes = sorted(set(rank_node))
    if minimum > size:
        raise ConfigError(f"{what} set size {size} is smaller than its minimum {minimum}")
    if len(nodes) < size:
        raise ConfigError(f"{what} set size {size} needs ranks on at least {size} nodes; this "
                          f"job has {len(rank_node)} ranks on {len(nodes)} node(s)")
    groups = _replica_groups(rank_node, shard_of, size) or _columns(rank_node)
    sets: list[list[int]] = []
    stragglers: list[int] = []
    for group in groups:
        chunks = [group[i:i + size] for i in range(0, len(group), size)]
        if len(chunks) > 1 and len(chunks[-1]) < minimum:
            chunks[-2].extend(chunks.pop())          # a short tail joins its neighbour
        if len(chunks[-1]) < minimum:
            stragglers.extend(chunks.pop())          # a whole group too small (uneven nodes)
        sets.extend(chunks)
    _place(stragglers, sets, rank_node, size, minimum, what)
    return [sorted(s, key=lambda r: (rank_node[r], r)) for s in sets]


def _place(pool: list[int], sets: list[list[int]], rank_node: Sequence[int], size: int,
           minimum: int, what: str) -> None:
    """Put leftover ranks of uneven nodes into sets, keeping every set on distinct nodes:
    form new sets from them (borrowing members of sets larger than ``minimum`` if needed),
    else let each join the smallest set without its node."""
    def nodes_of(members: list[int]) -> set[int]:
        return {rank_node[r] for r in members}
    while pool:
        new: list[int] = []
        for r in pool:
            if len(new) < size and rank_node[r] not in nodes_of(new):
                new.append(r)
        while len(new) < minimum:
            donors = [d for d in sets if len(d) > minimum
                      and any(rank_node[x] not in nodes_of(new) for x in d)]
            if not donors:
                break
            donor = max(donors, key=len)
            x = next(x for x in reversed(donor) if rank_node[x] not in nodes_of(new))
            donor.remove(x)
            new.append(x)
        if len(new) >= minimum:
            sets.append(new)
            pool = [r for r in pool if r not in new]
            continue
        for x in new:                       # give borrowed members back, then join
            if x not in pool:
                min((d for d in sets if rank_node[x] not in nodes_of(d)), key=len).append(x)
        for r in pool:
            fits = [d for d in sets if rank_node[r] not in nodes_of(d)]
            if not fits:
                raise ConfigError(
                    f"{what} sets need ranks on distinct nodes: rank {r} fits in no set of "
                    f"size {size} (minimum {minimum}); too many ranks on node {rank_node[r]}")
            min(fits, key=len).append(r)
        return


def set_of(sets: Sequence[Sequence[int]], rank: int) -> tuple[int, int]:
    """(set id, index in set) of ``rank``."""
    for sid, members in enumerate(sets):
        if rank in members:
            return sid, list(members).index(rank)
    raise KeyError(rank)


def dp_rings(rank_node: Sequence[int], shard_of: Sequence[tuple[int, int]]
             ) -> list[list[int]] | None:
    """The data-parallel replicas of every (tp, pp) shard (``shard_of[rank]``) in a ring
    whose neighbours, the last and the first included, sit on different nodes: the order in
    which replicas share a snapshot (ring position i holds slices i and i + 1, so every
    slice lives on two nodes). Rings in the order of their shard key; None when some shard
    has a single replica or cannot be so arranged (one node holds more than half of its
    replicas). Pure."""
    groups: dict[tuple[int, int], list[int]] = {}
    for rank, key in enumerate(shard_of):
        groups.setdefault((int(key[0]), int(key[1])), []).append(rank)
    rings = []
    for key in sorted(groups):
        ring = _apart(groups[key], rank_node)
        if ring is None:
            return None
        rings.append(ring)
    return rings


def _apart(ranks: Sequence[int], rank_node: Sequence[int]) -> list[int] | None:
    """``ranks`` in a circle with no two neighbours on one node: the ranks of the fullest
    node first fill the even places, then the odd ones (possible iff no node holds more
    than half of them); None when that fails or there is one rank."""
    if len(ranks) < 2:
        return None
    by_node: dict[int, list[int]] = {}
    for r in sorted(ranks):
        by_node.setdefault(rank_node[r], []).append(r)
    order = [r for node in sorted(by_node, key=lambda n: (-len(by_node[n]), n))
             for r in by_node[node]]
    places = list(range(0, len(order), 2)) + list(range(1, len(order), 2))
    ring = [0] * len(order)
    for place, r in zip(places, order):
        ring[place] = r
    if any(rank_node[ring[i]] == rank_node[ring[i - 1]] for i in range(len(ring))):
        return None
    return ring
