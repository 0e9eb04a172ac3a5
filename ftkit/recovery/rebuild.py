"""Execute a recovery :class:`~ftkit.recovery.plan.Plan`: rebuild lost shards over MPI, verify
them, then re-encode the step's redundancy so the next failure is covered too.

Every function here is a collective over the whole job: all ranks call it with the same plan.
Failures anywhere become the same CheckpointError on every rank.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from ftkit.comm.dist import DistComm
from ftkit.errors import one_line
from ftkit.faults import Faults
from ftkit.recovery.plan import Plan
from ftkit.storage.level import Redundancy, Report
from ftkit.storage.levels import Levels

log = logging.getLogger(__name__)


def execute(dc: DistComm, levels: Levels, faults: Faults, plan: Plan,
            reports: Sequence[Report], step_levels: Sequence[str]) -> None:
    """Rebuild (each redundancy level of the step its part, in encode order), verify,
    re-encode. All ranks call."""
    step = plan.step

    def _rebuild(level: Redundancy, have: list[bool], first: bool) -> None:
        if first:
            faults.fire("restore-rebuild", step)
        if level.name in plan.parts:
            level.rebuild(step, plan.parts[level.name], reports, have)

    have = [r not in plan.lost for r in range(len(reports))]
    for i, level in enumerate(levels.redundancy(step_levels)):
        dc.run(lambda lv=level, now=list(have), first=i == 0: _rebuild(lv, now, first),  # type: ignore[misc]
               "restore-rebuild", step)
        for r in level.cover.rebuilt(plan.parts.get(level.name, {})):
            have[r] = True
    dc.run(lambda: _verify(levels, plan, dc.size), "restore-rebuild", step)
    for level in levels.redundancy(step_levels):
        dc.run(lambda lv=level: lv.encode(step), "restore-rebuild", step)  # type: ignore[misc]


def _verify(levels: Levels, plan: Plan, world: int) -> None:
    if levels.local.rank not in plan.lost:
        return
    levels.local.check_shard(plan.step, world)


def local_report(levels: Levels, step: int, world: int, step_levels: Sequence[str], *,
                 data: bool = True) -> Report:
    """What this rank holds intact for ``step`` (own shard, and what each redundancy level of
    the step holds). *Any* failure to read or check one of them makes that one unusable, with
    a one-line reason (never an exception: every rank must reach the next collective).
    Without ``data`` no tensor byte is read, only headers: the load verifies the own shard's
    bytes as it reads them, a rebuild verifies the copies and parity it uses (streamed
    copies chunk by chunk, every rebuilt shard completely). Local."""
    report: Report = {"own": None}
    try:
        levels.local.check_shard(step, world, data=data)
    except Exception as exc:  # noqa: BLE001 - any failure: the shard is lost
        report["own"] = one_line(exc)
    for level in levels.redundancy(step_levels):
        report[level.name] = level.report(step, world, data=data)
    return report
