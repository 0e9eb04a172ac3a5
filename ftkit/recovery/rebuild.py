"""Execute a recovery :class:`~ftkit.recovery.plan.Plan`: rebuild lost shards over MPI, then
re-protect what the loss took (the copies and parity it held) so the next failure is covered
too.

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
            reports: Sequence[Report], step_levels: Sequence[str]) -> list[str]:
    """Rebuild (each redundancy level of the step its part, in encode order), check the
    rebuilt shards are in place, and re-protect what the loss took (only that: the copies and
    parity the reports name lost). Returns what was re-protected, one phrase per level that
    had to. All ranks call."""
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
    dc.run(lambda: _in_place(levels, plan, dc.size), "restore-rebuild", step)
    done: list[str] = []
    for level in levels.redundancy(step_levels):
        done += dc.run(lambda lv=level: lv.reprotect(step, reports),  # type: ignore[misc]
                       "restore-rebuild", step)
    return done


def _in_place(levels: Levels, plan: Plan, world: int) -> None:
    """A rebuilt shard is in its place with a valid header. Its bytes were verified as they
    landed (a copy streamed in, chunk by chunk) or before they were written (a decoded
    shard, against its recorded checksum), and the load verifies them once more as it
    reads them: no pass over them here."""
    if levels.local.rank in plan.lost:
        levels.local.check_shard(plan.step, world, data=False)


def local_report(levels: Levels, step: int, world: int, step_levels: Sequence[str], *,
                 data: bool = True) -> Report:
    """What this rank holds intact for ``step`` (own shard, and what each redundancy level of
    the step holds). *Any* failure to read or check one of them makes that one unusable, with
    a one-line reason (never an exception: every rank must reach the next collective).
    Without ``data`` no tensor byte is read, only headers: the load verifies the own shard's
    bytes as it reads them, a rebuild verifies the copies and parity it uses (streamed
    copies chunk by chunk, a decoded shard against its recorded checksum). Local."""
    report: Report = {"own": None}
    try:
        levels.local.check_shard(step, world, data=data)
    except Exception as exc:  # noqa: BLE001 - any failure: the shard is lost
        report["own"] = one_line(exc)
    for level in levels.redundancy(step_levels):
        report[level.name] = level.report(step, world, data=data)
    return report
