"""Which lost shards can be rebuilt from which level (pure; identical on every rank).

Input: every rank's report for one step (what it holds intact), the levels the step was
saved with and the covers of the configured redundancy levels (their placement over the
job). Output: a :class:`Plan` that names, for every rank whose own shard is lost, the level
that rebuilds it — or says why the step is unrecoverable, naming the level, the ranks and
their nodes. Levels are tried in encode order; a later level may rebuild what an earlier one
could not (an erasure set may lean on shards a partner copy brought back).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ftkit.storage.level import Cover, Report, ranks_text


@dataclasses.dataclass
class Plan:
    step: int
    lost: list[int]
    #: level name -> its part of the rebuild (:class:`~ftkit.storage.level.Cover`), in order
    parts: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: level name -> its cover's kind ("copy" or "parity")
    kinds: dict[str, str] = dataclasses.field(default_factory=dict)
    unrecoverable: str | None = None

    @property
    def ok(self) -> bool:
        return self.unrecoverable is None

    @property
    def from_partner(self) -> list[int]:
        """Ranks rebuilt from whole copies on other nodes."""
        return sorted(r for name, part in self.parts.items() if self.kinds[name] == "copy"
                      for r in part)

    @property
    def erasure(self) -> dict[str, dict[int, list[int]]]:
        """Parity level -> set id -> lost member indices it decodes."""
        return {name: part for name, part in self.parts.items()
                if self.kinds[name] == "parity"}

    def how(self) -> list[str]:
        """One phrase per level used: ``partner copies for ranks [2, 3]``."""
        return [f"{name} copies for ranks {part}" if self.kinds[name] == "copy" else
                f"{name} parity for sets {sorted(part)}" for name, part in self.parts.items()]


def make_plan(step: int, reports: Sequence[Report], levels: Sequence[str],
              covers: Sequence[Cover], node_name: Sequence[str]) -> Plan:
    """Decide how to recover ``step``. ``reports[r]["own"]`` is None when rank r's shard is
    intact; ``reports[r][name]`` is what rank r holds of redundancy level ``name`` (see the
    level's ``held``). Only covers of levels in ``levels`` (the step's) are used."""
    lost = [r for r, rep in enumerate(reports) if rep.get("own") is not None]
    plan = Plan(step, lost)
    if not lost:
        return plan
    have = [r not in lost for r in range(len(reports))]
    why: list[str] = []
    used = [cover for cover in covers if cover.name in levels]
    for cover in used:
        part, reasons = cover.solve(reports, have, node_name)
        why += reasons
        if part:
            plan.parts[cover.name] = part
            plan.kinds[cover.name] = cover.kind
    missing = [r for r in lost if not have[r]]
    if missing:
        names = [cover.name for cover in used] or ["local"]
        plan.unrecoverable = (
            f"step {step} is unrecoverable at level {'/'.join(names)}: the shards of "
            f"{ranks_text(missing, node_name)} are lost"
            + ("; " + "; ".join(why) if why else "; no redundancy level covers this step"))
    return plan
