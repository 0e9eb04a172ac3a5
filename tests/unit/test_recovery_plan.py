"""ftkit.recovery.plan.make_plan: which lost shards each redundancy level can rebuild."""
from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from ftkit.comm.placement import erasure_sets, partner_map
from ftkit.comm.topology import virtual_nodes
from ftkit.recovery.plan import Plan, make_plan
from ftkit.storage.level import Cover
from ftkit.storage.redundancy.erasure import ErasureCover, parity_ok
from ftkit.storage.redundancy.partner import PartnerCover

HEADER = {"seg": 64, "sizes": [10, 10, 10, 10], "checksums": ["a", "b", "c", "d"]}


class Job:
    """A job of ``world`` ranks on virtual nodes of ``rpn`` ranks, with placement from
    ftkit.comm.placement, and the restore reports every rank would send."""

    def __init__(self, world: int, rpn: int, levels: tuple[str, ...], xor: int = 4,
                 rs: int = 4, rs_parity: int = 2) -> None:
        self.world = world
        self.rank_node = virtual_nodes(world, rpn)
        self.levels = list(levels)
        self.partners = partner_map(self.rank_node) if "partner" in levels else None
        self.sets: dict[str, list[list[int]]] = {}
        self.parity: dict[str, int] = {}
        if "xor" in levels:
            self.sets["xor"] = erasure_sets(self.rank_node, xor, minimum=2, what="xor")
            self.parity["xor"] = 1
        if "rs" in levels:
            self.sets["rs"] = erasure_sets(self.rank_node, rs, minimum=rs_parity + 1,
                                           what="rs")
            self.parity["rs"] = rs_parity
        self.node_name = [f"node-{n}" for n in self.rank_node]
        self.reports: list[dict[str, Any]] = []
        for r in range(world):
            rep: dict[str, Any] = {"own": None}
            if self.partners is not None:
                rep["partner"] = {str(q): None for q, h in enumerate(self.partners) if h == r}
            for level in ("xor", "rs"):
                if level in levels:
                    rep[level] = dict(HEADER)
            self.reports.append(rep)

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.rank_node) if n == node]

    def lose_node(self, node: int) -> None:
        """The node's directory is gone: no own shard, no partner copy, no parity."""
        for r in self.ranks_on(node):
            rep = self.reports[r]
            rep["own"] = f"rank-{r}.ftk is missing"
            if "partner" in rep:
                rep["partner"] = {}
            for level in ("xor", "rs"):
                if level in rep:
                    rep[level] = None

    def corrupt_own(self, rank: int) -> None:
        self.reports[rank]["own"] = "checksum mismatch in model/w"

    def corrupt_partner_copy(self, source: int) -> None:
        assert self.partners is not None
        self.reports[self.partners[source]]["partner"][str(source)] = "checksum mismatch"

    def corrupt_parity(self, level: str, rank: int) -> None:
        self.reports[rank][level] = {"error": f"{level} parity of rank {rank} damaged"}

    def plan(self, step: int = 7) -> Plan:
        return make_plan(step, self.reports, self.levels, self.covers(), self.node_name)

    def covers(self) -> list[Cover]:
        """The covers a job with this placement builds, in encode order."""
        out: list[Cover] = [PartnerCover(self.partners)] if self.partners is not None else []
        return out + [ErasureCover(name, self.sets[name], self.parity[name])
                      for name in ("xor", "rs") if name in self.sets]


def test_nothing_lost() -> None:
    job = Job(8, 2, ("local", "partner", "xor", "rs"))
    plan = job.plan()
    assert plan.ok and plan.lost == [] and plan.from_partner == [] and plan.erasure == {}
    assert plan.step == 7


def test_nothing_lost_without_redundancy() -> None:
    job = Job(4, 2, ("local",))
    assert job.plan().ok


def test_lost_without_redundancy_is_unrecoverable() -> None:
    job = Job(4, 2, ("local",))
    job.corrupt_own(3)
    plan = job.plan()
    assert not plan.ok and plan.lost == [3]
    msg = str(plan.unrecoverable)
    assert "step 7 is unrecoverable at level local" in msg
    assert "rank(s) 3 on node-1" in msg and "no redundancy level" in msg


def test_one_node_lost_partner_copies_intact() -> None:
    job = Job(8, 2, ("local", "partner"))
    job.lose_node(1)
    plan = job.plan()
    assert plan.ok, plan.unrecoverable
    assert plan.lost == [2, 3] and plan.from_partner == [2, 3] and plan.erasure == {}


def test_partner_preferred_over_erasure() -> None:
    job = Job(8, 2, ("local", "partner", "xor"))
    job.lose_node(3)
    plan = job.plan()
    assert plan.ok and plan.from_partner == [6, 7] and plan.erasure == {}


def test_partner_copy_corrupted_falls_back_to_xor() -> None:
    job = Job(8, 2, ("local", "partner", "xor"))
    job.lose_node(1)                    # ranks 2, 3
    job.corrupt_partner_copy(3)
    plan = job.plan()
    assert plan.ok, plan.unrecoverable
    assert plan.lost == [2, 3] and plan.from_partner == [2]
    sid = next(i for i, s in enumerate(job.sets["xor"]) if 3 in s)
    assert plan.erasure == {"xor": {sid: [job.sets["xor"][sid].index(3)]}}


def test_partner_copy_corrupted_without_xor_is_unrecoverable() -> None:
    job = Job(8, 2, ("local", "partner"))
    job.lose_node(1)
    job.corrupt_partner_copy(3)
    assert job.partners is not None
    holder = job.partners[3]
    plan = job.plan()
    assert not plan.ok and plan.from_partner == [2]
    msg = str(plan.unrecoverable)
    assert "unrecoverable at level partner" in msg
    assert "rank(s) 3 on node-1" in msg
    assert f"copy of rank 3 on rank {holder} (node-{job.rank_node[holder]}) is damaged" in msg
    assert "checksum mismatch" in msg


def test_long_damage_reason_is_shortened() -> None:
    job = Job(4, 2, ("local", "partner"))
    job.lose_node(0)
    assert job.partners is not None
    job.reports[job.partners[1]]["partner"]["1"] = "x" * 500
    msg = str(job.plan().unrecoverable)
    assert "x" * 157 + "..." in msg and "x" * 158 not in msg


def test_two_lost_nodes_holding_a_partner_pair() -> None:
    # 2 nodes: every rank's copy is on the other node
    job = Job(4, 2, ("local", "partner"))
    job.lose_node(0)
    job.lose_node(1)
    plan = job.plan()
    assert not plan.ok and plan.from_partner == []
    msg = str(plan.unrecoverable)
    assert "unrecoverable at level partner" in msg
    assert "rank(s) 0, 1, 2, 3 on node-0, node-1" in msg
    assert "copy of rank 0 on rank 2 (node-1) is missing" in msg
    assert "copy of rank 2 on rank 0 (node-0) is missing" in msg


def test_two_adjacent_nodes_of_a_ring() -> None:
    # 4 nodes: node 1 holds node 0's copies, so losing both loses node 0's ranks only
    job = Job(8, 2, ("local", "partner"))
    job.lose_node(0)
    job.lose_node(1)
    plan = job.plan()
    assert not plan.ok and plan.from_partner == [2, 3]
    msg = str(plan.unrecoverable)
    assert "rank(s) 0, 1 on node-0 are lost" in msg
    assert "node-1 are lost" not in msg


def test_two_non_adjacent_nodes_of_a_ring() -> None:
    job = Job(8, 2, ("local", "partner"))
    job.lose_node(0)
    job.lose_node(2)
    plan = job.plan()
    assert plan.ok and plan.from_partner == [0, 1, 4, 5]


def test_xor_losing_two_members_is_unrecoverable() -> None:
    job = Job(8, 2, ("local", "xor"))
    job.lose_node(0)
    job.lose_node(2)
    plan = job.plan()
    assert not plan.ok
    msg = str(plan.unrecoverable)
    assert "unrecoverable at level xor" in msg
    assert "rank(s) 0, 1, 4, 5 on node-0, node-2" in msg
    assert "xor: set 0 [0, 2, 4, 6] lost the shards of rank(s) 0, 4 on node-0, node-2" in msg
    assert "tolerates 1 lost member(s)" in msg


def test_xor_losing_one_member_per_set() -> None:
    job = Job(8, 2, ("local", "xor"))
    job.lose_node(2)
    plan = job.plan()
    assert plan.ok and plan.from_partner == []
    assert plan.erasure == {"xor": {0: [2], 1: [2]}}


def test_rs_two_parity_survives_two_lost_nodes() -> None:
    job = Job(8, 2, ("local", "rs"))
    assert job.sets["rs"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    job.lose_node(0)
    job.lose_node(2)
    plan = job.plan()
    assert plan.ok, plan.unrecoverable
    assert plan.lost == [0, 1, 4, 5]
    assert plan.erasure == {"rs": {0: [0, 2], 1: [0, 2]}}


def test_rs_three_lost_nodes_is_unrecoverable() -> None:
    job = Job(8, 2, ("local", "rs"))
    for node in (0, 1, 3):
        job.lose_node(node)
    plan = job.plan()
    assert not plan.ok
    msg = str(plan.unrecoverable)
    assert "unrecoverable at level rs" in msg and "tolerates 2 lost member(s)" in msg
    assert "3 parity block(s)" in msg


def test_xor_fails_but_rs_rebuilds() -> None:
    job = Job(8, 2, ("local", "xor", "rs"))
    job.lose_node(1)
    job.lose_node(3)
    plan = job.plan()
    assert plan.ok, plan.unrecoverable
    assert "xor" not in plan.erasure
    assert plan.erasure == {"rs": {0: [1, 3], 1: [1, 3]}}


def test_partner_rebuild_counts_as_data_for_xor() -> None:
    # node 0 is gone; rank 2 (node 1, same xor set) lost only its own shard. Rank 0's copy
    # lived on node 1 and is damaged, rank 2's copy on node 2 is intact: partner rebuilds 2,
    # after which the xor set has a single lost member (0).
    job = Job(8, 2, ("local", "partner", "xor"))
    job.lose_node(0)
    job.corrupt_own(2)
    job.corrupt_partner_copy(0)
    plan = job.plan()
    assert plan.ok, plan.unrecoverable
    assert plan.lost == [0, 1, 2] and plan.from_partner == [1, 2]
    assert plan.erasure == {"xor": {0: [0]}}
    # without the partner copy of rank 2 the xor set would have lost two members
    job.corrupt_partner_copy(2)
    plan = job.plan()
    assert not plan.ok and "xor: set 0" in str(plan.unrecoverable)


def test_partner_rebuild_counts_as_data_for_rs() -> None:
    # nodes 0 and 1 gone: ranks 0, 2 (set 0) without partner copies (the ring puts node 0's
    # copies on node 1); rank 4 (set 0, node 2) lost its own shard but has an intact copy
    job = Job(8, 2, ("local", "partner", "rs"))
    job.lose_node(0)
    job.lose_node(1)
    job.corrupt_own(4)
    plan = job.plan()
    assert plan.ok, plan.unrecoverable
    assert plan.from_partner == [2, 3, 4]
    assert plan.erasure == {"rs": {0: [0], 1: [0]}}


def test_lost_node_parity_also_unusable_in_xor() -> None:
    # nodes 0 and 1 lost: rank 2 (xor member 1 of set 0) comes back from partner, but its
    # parity file went with node 1, and stripe 1 needs it to rebuild member 0
    job = Job(8, 2, ("local", "partner", "xor"))
    job.lose_node(0)
    job.lose_node(1)
    plan = job.plan()
    assert plan.from_partner == [2, 3]
    assert not plan.ok
    assert "xor: set 0 [0, 2, 4, 6] lost the shards of rank(s) 0 on node-0 and 2 parity" \
        in str(plan.unrecoverable)


@pytest.mark.parametrize("level,parity_loss,ok", [
    ("xor", [], True),
    ("xor", [0], True),      # the lost member's own parity is not needed for its data
    ("xor", [4], False),     # stripe 2 (data 0, 2, 6) loses its parity holder (member 2)
    ("rs", [4], True),       # stripe 1 keeps data 6 + parity of 2; stripe 2 data 2 + parity 6
    ("rs", [6], True),
    ("rs", [2, 4], False),   # stripe 1: parity holders 1 and 2 both damaged, data 6 only
    ("rs", [4, 6], False),   # stripe 2: parity holders 2 and 3 both damaged, data 2 only
    ("rs", [2, 6], True),    # stripe 1: data 6 + parity of 4; stripe 2: data 2 + parity of 4
])
def test_lost_member_with_damaged_parity_elsewhere(level: str, parity_loss: list[int],
                                                   ok: bool) -> None:
    # xor set / rs set 0 = ranks [0, 2, 4, 6] (members 0..3); rank 0 lost its own shard
    job = Job(8, 2, ("local", level))
    assert job.sets[level][0] == [0, 2, 4, 6]
    job.corrupt_own(0)
    for rank in parity_loss:
        job.corrupt_parity(level, rank)
    plan = job.plan()
    assert plan.ok == ok, plan.unrecoverable
    if ok:
        assert plan.erasure == {level: {0: [0]}}
    else:
        assert f"{len(parity_loss)} parity block(s)" in str(plan.unrecoverable)


def test_parity_ok() -> None:
    assert parity_ok({"xor": dict(HEADER)}, "xor")
    assert not parity_ok({"xor": None}, "xor")
    assert not parity_ok({}, "xor")
    assert not parity_ok({"xor": {"error": "bad"}}, "xor")


def _expected_solvable(k: int, p: int, lost: set[int], parity_bad: set[int]) -> bool:
    """Independent MDS criterion: every stripe t (parity on members t..t+p-1 mod k) with
    lost data keeps at least k - p intact segments."""
    for t in range(k):
        hold = {(t + j) % k for j in range(p)}
        data = set(range(k)) - hold
        if not data & lost:
            continue
        if len(data - lost) + len(hold - parity_bad) < k - p:
            return False
    return True


@pytest.mark.parametrize("k,p", [(k, p) for k in range(2, 7) for p in range(1, k)])
def test_erasure_solvability_matches_stripe_criterion(k: int, p: int) -> None:
    """One set of k members on k nodes: every combination of lost own shards and damaged
    parity files (random subsample for big sets)."""
    level = "xor" if p == 1 else "rs"
    job = Job(k, 1, ("local", level), xor=k, rs=k, rs_parity=max(p, 2))
    job.parity[level] = p
    job.sets[level] = [list(range(k))]
    combos = list(itertools.product(range(2 ** k), repeat=2))
    if len(combos) > 600:
        combos = random.Random(k * 10 + p).sample(combos, 600)
    for lost_bits, bad_bits in combos:
        lost = {i for i in range(k) if lost_bits >> i & 1}
        bad = {i for i in range(k) if bad_bits >> i & 1}
        reports = [{"own": "lost" if i in lost else None,
                    level: {"error": "x"} if i in bad else dict(HEADER)} for i in range(k)]
        plan = make_plan(3, reports, [level], job.covers(), job.node_name)
        want = not lost or _expected_solvable(k, p, lost, bad)
        assert plan.ok == want, (k, p, sorted(lost), sorted(bad))
        assert plan.lost == sorted(lost)
        if lost and want:
            assert plan.erasure == {level: {0: sorted(lost)}}
        if not want:
            assert len(lost) > p or bad
