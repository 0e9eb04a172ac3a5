"""``ftkit advise``: how likely each scheme survives k simultaneous node failures, and how
often each level should be written (Young/Daly).

Survival is computed *exactly* from the real placement code (:mod:`ftkit.comm.placement`):
a set F of failed nodes is fatal for a scheme when some rank's data is gone everywhere —
partner: a rank and its partner both on F; XOR/RS: more than p members of one set on F;
local: any failure; pfs: never. The failed sets are counted per connected component of the
constraint (hyper)graph and combined by polynomial multiplication; a component too large to
enumerate is counted in closed form when it is a cycle or a path (the partner ring).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from ftkit.comm.placement import erasure_sets, partner_map
from ftkit.comm.topology import virtual_nodes

ENUMERATE_LIMIT = 20   # nodes per component enumerated exhaustively (2^20 subsets)


@dataclasses.dataclass(frozen=True)
class Scheme:
    """Node-level loss constraints of one scheme: groups of nodes and how many may fail."""

    name: str
    groups: tuple[tuple[int, ...], ...]   # each: the nodes of one set / partner edge
    tolerate: int                          # failures tolerated inside one group
    nodes: int

    def fatal(self, failed: set[int]) -> bool:
        return any(sum(n in failed for n in g) > self.tolerate for g in self.groups)


def schemes(nodes: int, ranks_per_node: int, xor_set: int, rs_set: int, rs_parity: int
            ) -> list[Scheme]:
    """The schemes of a job of ``nodes`` x ``ranks_per_node`` ranks, from real placement."""
    rank_node = virtual_nodes(nodes * ranks_per_node, ranks_per_node)
    out = [Scheme("local", tuple((n,) for n in range(nodes)), 0, nodes)]
    if nodes >= 2:
        partners = partner_map(rank_node)
        edges = {tuple(sorted((rank_node[r], rank_node[p]))) for r, p in enumerate(partners)}
        out.append(Scheme("partner", tuple(sorted(edges)), 1, nodes))
    for name, size, p in (("xor", xor_set, 1), ("rs", rs_set, rs_parity)):
        if nodes >= size:
            sets = erasure_sets(rank_node, size, minimum=p + 1, what=name)
            groups = {tuple(sorted(rank_node[r] for r in s)) for s in sets}
            out.append(Scheme(name, tuple(sorted(groups)), p, nodes))
    out.append(Scheme("pfs", (), 0, nodes))
    return out


def unplaceable(nodes: int, xor_set: int, rs_set: int) -> list[dict[str, str]]:
    """The redundancy schemes a job on ``nodes`` nodes cannot place, and why (pure)."""
    out = []
    if nodes < 2:
        out.append({"scheme": "partner", "why": "a copy on another node needs >= 2 nodes"})
    for name, size in (("xor", xor_set), ("rs", rs_set)):
        if nodes < size:
            out.append({"scheme": name, "why": f"a set of {size} members on distinct nodes "
                                               f"needs >= {size} nodes"})
    return out


def survivable_counts(scheme: Scheme) -> list[int]:
    """``counts[k]`` = number of k-node failure sets the scheme survives (exact)."""
    poly = [1]
    for comp, groups in _components(scheme):
        poly = _multiply(poly, _component_counts(comp, groups, scheme.tolerate))
    return poly + [0] * (scheme.nodes + 1 - len(poly))


def survival_probability(scheme: Scheme, k: int) -> float:
    """P(the scheme survives k simultaneous node failures, uniformly chosen)."""
    if k > scheme.nodes:
        return 0.0
    return survivable_counts(scheme)[k] / math.comb(scheme.nodes, k)


def _components(scheme: Scheme) -> list[tuple[list[int], list[tuple[int, ...]]]]:
    parent = list(range(scheme.nodes))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x
    for g in scheme.groups:
        for n in g[1:]:
            parent[find(n)] = find(g[0])
    comps: dict[int, list[int]] = {}
    for n in range(scheme.nodes):
        comps.setdefault(find(n), []).append(n)
    return [(nodes, [g for g in scheme.groups if g and find(g[0]) == root])
            for root, nodes in comps.items()]


def _component_counts(nodes: list[int], groups: list[tuple[int, ...]], tolerate: int
                      ) -> list[int]:
    if len(nodes) <= ENUMERATE_LIMIT:
        counts = [0] * (len(nodes) + 1)
        for mask in range(1 << len(nodes)):
            failed = {n for i, n in enumerate(nodes) if mask >> i & 1}
            if not any(sum(n in failed for n in g) > tolerate for g in groups):
                counts[len(failed)] += 1
        return counts
    return _graph_counts(nodes, groups)


def _graph_counts(nodes: list[int], groups: list[tuple[int, ...]]) -> list[int]:
    """Independent sets by size of a large cycle or path (pairs with tolerate = 1)."""
    edges = {g for g in groups if len(g) == 2 and g[0] != g[1]}
    degree = {n: 0 for n in nodes}
    for a, b in edges:
        degree[a] += 1
        degree[b] += 1
    n = len(nodes)
    if any(len(g) != 2 for g in groups) or max(degree.values()) > 2:
        raise ValueError(f"component of {n} nodes is too large to count exactly")
    if len(edges) == n:      # cycle: n/(n-k) * C(n-k, k)
        return [1] + [n * math.comb(n - k, k) // (n - k) for k in range(1, n)] + [0]
    return [math.comb(n - k + 1, k) for k in range(n + 1)]       # path


def _multiply(a: Sequence[int], b: Sequence[int]) -> list[int]:
    out = [0] * (len(a) + len(b) - 1)
    for i, x in itertools.product(range(len(a)), range(len(b))):
        out[i + x] += a[i] * b[x]
    return out


def young(cost_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval sqrt(2 C M)."""
    return math.sqrt(2 * cost_s * mtbf_s)


def daly(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimal interval (for C < 2M), else M."""
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    r = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - cost_s


def advise(nodes: int, mtbf_hours: float, *, ranks_per_node: int = 1, xor_set: int = 4,
           rs_set: int = 4, rs_parity: int = 2, max_failures: int = 3,
           costs: dict[str, float] | None = None,
           cost_sources: dict[str, str] | None = None) -> dict[str, object]:
    """Survival table and checkpoint intervals (pure; what ``ftkit advise`` prints).
    ``cost_sources`` says where each level's cost came from (a bench file, ``--cost``)."""
    mtbf_s = mtbf_hours * 3600.0 / nodes          # the job fails when any node fails
    rows = []
    for scheme in schemes(nodes, ranks_per_node, xor_set, rs_set, rs_parity):
        counts = survivable_counts(scheme)
        row: dict[str, object] = {
            "scheme": scheme.name,
            "survive": {str(k): counts[k] / math.comb(nodes, k)
                        for k in range(1, min(max_failures, nodes) + 1)}}
        cost = (costs or {}).get(scheme.name)
        if cost is not None:
            row.update(cost_s=cost, young_s=young(cost, mtbf_s), daly_s=daly(cost, mtbf_s))
        rows.append(row)
    return {"nodes": nodes, "ranks_per_node": ranks_per_node, "node_mtbf_hours": mtbf_hours,
            "job_mtbf_s": mtbf_s, "schemes": rows,
            "not_possible": unplaceable(nodes, xor_set, rs_set),
            "costs": {level: {"seconds": cost, "from": (cost_sources or {}).get(level, "given")}
                      for level, cost in sorted((costs or {}).items())}}


def render(report: dict[str, object]) -> str:
    """Human-readable table of :func:`advise`'s report."""
    rows: list[dict[str, object]] = report["schemes"]  # type: ignore[assignment]
    ks = list(rows[0]["survive"]) if rows else []      # type: ignore[call-overload]
    head = f"{'scheme':8}" + "".join(f"{'P(survive ' + k + ')':>15}" for k in ks) + \
        f"{'cost':>10}{'Young':>12}{'Daly':>12}"
    title = (f"{report['nodes']} nodes x {report['ranks_per_node']} ranks, node MTBF "
             f"{report['node_mtbf_hours']} h -> job MTBF {report['job_mtbf_s']:.0f} s")
    lines = [title, head]
    for row in rows:
        surv: dict[str, float] = row["survive"]  # type: ignore[assignment]
        line = f"{row['scheme']:8}" + "".join(f"{surv[k]:>15.4f}" for k in ks)
        if "cost_s" in row:
            line += f"{row['cost_s']:>9.3g}s{row['young_s']:>11.0f}s{row['daly_s']:>11.0f}s"
        lines.append(line)
    for row in report.get("not_possible", []):         # type: ignore[attr-defined]
        lines.append(f"{row['scheme']:8} not possible here: {row['why']}")
    costs: dict[str, dict[str, object]] = report.get("costs", {})  # type: ignore[assignment]
    if costs:
        lines.append("checkpoint costs used: " + ", ".join(
            f"{level} {c['seconds']:g} s ({c['from']})" for level, c in costs.items()))
    else:
        lines.append("no checkpoint costs given (--measured BENCH.json or --cost "
                     "LEVEL=SECONDS): the Young/Daly intervals are not computed")
    return "\n".join(lines)
