"""Execute a recovery :class:`~ftkit.recovery.plan.Plan`: rebuild lost shards over MPI, verify
them, then re-encode the step's redundancy so the next failure is covered too.

Every function here is a collective over the whole job: all ranks call it with the same plan.
Failures anywhere become the same CheckpointError on every rank.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from ftkit.comm.dist import DistComm
from ftkit.faults import Faults
from ftkit.recovery.plan import Plan, Report, one_line, parity_ok
from ftkit.storage.levels import Levels

log = logging.getLogger(__name__)


def execute(dc: DistComm, levels: Levels, faults: Faults, plan: Plan,
            reports: Sequence[Report], step_levels: Sequence[str]) -> None:
    """Rebuild, verify, re-encode. All ranks call."""
    step = plan.step

    def _rebuild() -> None:
        faults.fire("restore-rebuild", step)
        if levels.partner is not None and "partner" in step_levels:
            levels.partner.rebuild(step, plan.from_partner)
    dc.run(_rebuild, "restore-rebuild", step)
    dc.run(lambda: _erasure(levels, plan, reports), "restore-rebuild", step)
    dc.run(lambda: _verify(levels, plan, dc.size), "restore-rebuild", step)
    for level in levels.redundancy(tuple(step_levels)):
        dc.run(lambda lv=level: lv.encode(step), "restore-rebuild", step)  # type: ignore[misc]


def _erasure(levels: Levels, plan: Plan, reports: Sequence[Report]) -> None:
    have = {r for r in range(len(reports)) if r not in plan.lost} | set(plan.from_partner)
    for name, per_set in plan.erasure.items():
        level = levels.erasure[name]
        members = levels.sets[name][level.set_id]
        if level.set_id in per_set:
            lost = per_set[level.set_id]
            header = next(reports[r][name] for r in members if parity_ok(reports[r], name))
            level.rebuild(plan.step, lost, [r in have for r in members],
                          [parity_ok(reports[r], name) for r in members], header)
        for sid, lost in per_set.items():
            have |= {levels.sets[name][sid][i] for i in lost}


def _verify(levels: Levels, plan: Plan, world: int) -> None:
    if levels.local.rank not in plan.lost:
        return
    levels.local.check_shard(plan.step, world)


def local_report(levels: Levels, step: int, world: int, step_levels: Sequence[str], *,
                 data: bool = True) -> Report:
    """What this rank holds intact for ``step`` (own shard, partner copies, parity). *Any*
    failure to read or check one of them makes that one unusable, with a one-line reason
    (never an exception: every rank must reach the next collective). Without ``data`` no
    tensor byte is read, only headers: the load verifies the own shard's bytes as it reads
    them, a rebuild verifies the copies and parity it uses (streamed copies chunk by chunk,
    every rebuilt shard completely). Local."""
    report: Report = {"own": None}
    try:
        levels.local.check_shard(step, world, data=data)
    except Exception as exc:  # noqa: BLE001 - any failure: the shard is lost
        report["own"] = one_line(exc)
    partner = levels.partner
    if partner is not None and "partner" in step_levels:
        try:
            held = partner.held(step, world, data=data)
        except Exception as exc:  # noqa: BLE001 - any failure: the copies are unusable
            held = {q: one_line(exc) for q in partner.sources}
        report["partner"] = {str(q): why for q, why in held.items()}
    for name, level in levels.erasure.items():
        if name in step_levels:
            try:
                report[name] = level.held(step, data=data)
            except Exception as exc:  # noqa: BLE001 - any failure: the parity is unusable
                report[name] = {"error": one_line(exc)}
    return report
