"""Which lost shards can be rebuilt from which level (pure; identical on every rank).

Input: every rank's report for one step (what it holds intact), the levels the step was
saved with, the partner map and the erasure sets. Output: a :class:`Plan` that names, for
every rank whose own shard is lost, the level that rebuilds it — or says why the step is
unrecoverable, naming the level, the ranks and their nodes.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ftkit.errors import FtkitError
from ftkit.storage.redundancy.stripes import Layout

Report = dict[str, Any]


@dataclasses.dataclass
class Plan:
    step: int
    lost: list[int]
    from_partner: list[int] = dataclasses.field(default_factory=list)
    # level -> set id -> lost member indices (in set order)
    erasure: dict[str, dict[int, list[int]]] = dataclasses.field(default_factory=dict)
    unrecoverable: str | None = None

    @property
    def ok(self) -> bool:
        return self.unrecoverable is None


def parity_ok(report: Report, level: str) -> bool:
    held = report.get(level)
    return isinstance(held, dict) and "error" not in held


def make_plan(step: int, reports: Sequence[Report], levels: Sequence[str],
              partners: Sequence[int] | None, sets: dict[str, list[list[int]]],
              parity: dict[str, int], node_name: Sequence[str]) -> Plan:
    """Decide how to recover ``step``. ``reports[r]["own"]`` is None when rank r's shard is
    intact; ``reports[r]["partner"]`` maps source rank (str) to None/why for the copies r
    holds; ``reports[r][level]`` is the parity header, ``{"error": ...}`` or None."""
    lost = [r for r, rep in enumerate(reports) if rep.get("own") is not None]
    plan = Plan(step, lost)
    if not lost:
        return plan
    have = [r not in lost for r in range(len(reports))]
    why: list[str] = []
    if "partner" in levels and partners is not None:
        for r in lost:
            holder = partners[r]
            state = reports[holder].get("partner", {}).get(str(r), "missing")
            if state is None:
                plan.from_partner.append(r)
                have[r] = True
            else:
                why.append(f"partner: the copy of rank {r} on rank {holder} "
                           f"({node_name[holder]}) is {_short(state)}")
    for level in ("xor", "rs"):
        if level not in levels or level not in sets:
            continue
        for sid, members in enumerate(sets[level]):
            idx = [i for i, r in enumerate(members) if not have[r]]
            if not idx:
                continue
            p_ok = [parity_ok(reports[r], level) for r in members]
            if _solvable(Layout(len(members), parity[level]), idx, [have[r] for r in members],
                         p_ok):
                plan.erasure.setdefault(level, {})[sid] = idx
                for i in idx:
                    have[members[i]] = True
            else:
                gone = [members[i] for i in idx]
                why.append(f"{level}: set {sid} {members} lost the shards of "
                           f"{_ranks(gone, node_name)} and {p_ok.count(False)} parity "
                           f"block(s); it tolerates {parity[level]} lost member(s)")
    missing = [r for r in lost if not have[r]]
    if missing:
        used = [lv for lv in ("partner", "xor", "rs") if lv in levels] or ["local"]
        plan.unrecoverable = (
            f"step {step} is unrecoverable at level {'/'.join(used)}: the shards of "
            f"{_ranks(missing, node_name)} are lost"
            + ("; " + "; ".join(why) if why else "; no redundancy level covers this step"))
    return plan


def _solvable(layout: Layout, lost_idx: list[int], data_ok: list[bool],
              parity_ok_: list[bool]) -> bool:
    for t in range(layout.k):
        dm = layout.data_members(t)
        if not any(mem in lost_idx for mem in dm):
            continue
        avail = sum(data_ok[mem] for mem in dm) + sum(parity_ok_[h] for h in layout.holders(t))
        if avail < layout.m:
            return False
    return True


def one_line(exc: BaseException, limit: int = 400) -> str:
    """An exception as one short line: the reason a copy or a step is unusable. ftkit's own
    errors already name file, rank and step; anything else is prefixed with its type."""
    text = str(exc) if isinstance(exc, FtkitError) else f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _short(state: object) -> str:
    if state == "missing":
        return "missing"
    text = str(state)
    return "damaged (" + (text if len(text) < 160 else text[:157] + "...") + ")"


def _ranks(ranks: Sequence[int], node_name: Sequence[str]) -> str:
    nodes = sorted({node_name[r] for r in ranks})
    return f"rank(s) {', '.join(map(str, ranks))} on {', '.join(nodes)}"
