"""Restore the newest step that is committed and recoverable on every rank (DESIGN §4).

Phases: ``restore-discover`` (ranks exchange inventories over MPI; for each committed step,
newest first, every rank verifies what it holds and a :mod:`plan <ftkit.recovery.plan>` says
whether lost shards can be rebuilt), ``restore-rebuild`` (partner copies / XOR / RS decoding
over MPI, see :mod:`ftkit.recovery.rebuild`), ``restore-load``. A rank only reads its own
node's directory; everything from another node travels over MPI.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, MutableMapping
from typing import Any

from ftkit.capture.apply import load_into
from ftkit.capture.flatten import leaf_from_bytes, unflatten
from ftkit.comm.dist import DistComm
from ftkit.errors import CheckpointError
from ftkit.recovery import rebuild
from ftkit.recovery.plan import make_plan
from ftkit.storage.levels import Levels
from ftkit.storage.shard import leaves_of
from ftkit.testing.faults import Faults

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Discovery:
    """Result of discovery, identical on every rank."""

    step: int                       # 0 when nothing usable is committed
    committed: list[int]            # every step committed somewhere, newest first
    skipped: dict[int, str]         # step -> why it was not usable
    levels_of: dict[int, list[str]]  # step -> levels it was saved with
    foreign: CheckpointError | None = None   # local steps of another world size (untouched)


def discover(dc: DistComm, levels: Levels, faults: Faults,
             emit: Callable[..., None], *, foreign_ok: bool = False) -> Discovery:
    """Agree on the newest committed step every rank can load, rebuilding lost shards when
    a redundancy level allows. All ranks call."""
    faults.fire("restore-discover", None)
    local = levels.local
    mine = {"node": local.root.name,
            "steps": {str(s): {"c": v["committed"], **local.record_info(s)}
                      for s, v in local.inventory().items()}}
    gathered = dc.allgather(mine, "restore-discover")
    nodes = [g["node"] for g in gathered]
    every = [g["steps"] for g in gathered]
    committed = sorted({int(s) for inv in every for s, v in inv.items() if v["c"]},
                       reverse=True)
    foreign, error = _foreign_world(every, committed, dc.size, local.root.parent)
    committed = [s for s in committed if s not in foreign]
    levels_of = {s: sorted({lv for inv in every for lv in inv.get(str(s), {}).get("levels", [])})
                 or ["local"] for s in committed}
    found = Discovery(0, committed, {}, levels_of, foreign=error)
    for step in committed:
        reports = dc.allgather(rebuild.local_report(levels, step, dc.size, levels_of[step]),
                               "restore-discover", step)
        plan = make_plan(step, reports, levels_of[step], levels.partners, levels.sets,
                         levels.parity, nodes)
        if plan.ok and plan.lost:
            plan.unrecoverable = _try_rebuild(dc, levels, faults, plan, reports,
                                              levels_of[step], emit, nodes)
        if plan.ok:
            found.step = step
            return found
        found.skipped[step] = str(plan.unrecoverable)
        failures = {r: rep["own"] for r, rep in enumerate(reports) if rep["own"] is not None}
        if dc.rank == 0:
            detail = "; ".join(f"rank {r}: {f}" for r, f in failures.items())
            log.warning("restore: committed step %d is unusable, trying an older one: %s. %s",
                        step, detail or "no shard lost", plan.unrecoverable)
        emit("restore-skip", step=step, failures=failures, reason=plan.unrecoverable)
    if error is not None and not foreign_ok:
        raise error             # nothing usable: never start over on top of those steps
    if committed and dc.rank == 0:
        log.warning("restore: none of the committed steps %s is recoverable; starting over",
                    committed)
    return found


def _try_rebuild(dc: DistComm, levels: Levels, faults: Faults, plan: Any, reports: Any,
                 step_levels: list[str], emit: Callable[..., None], nodes: list[str]
                 ) -> str | None:
    lost_nodes = sorted({nodes[r] for r in plan.lost})
    how = ([f"partner copies for ranks {plan.from_partner}"] if plan.from_partner else []) + \
        [f"{lv} parity for sets {sorted(per)}" for lv, per in plan.erasure.items()]
    t0 = time.monotonic()
    try:
        rebuild.execute(dc, levels, faults, plan, reports, step_levels)
    except CheckpointError as exc:
        return f"rebuild of step {plan.step} failed: {exc}"
    seconds = round(time.monotonic() - t0, 6)
    if dc.rank == 0:
        log.warning("restore: step %d: rebuilt the shards of ranks %s (lost on %s) from %s",
                    plan.step, plan.lost, ", ".join(lost_nodes), "; ".join(how))
    emit("rebuild", step=plan.step, ranks=plan.lost, nodes=lost_nodes,
         from_partner=plan.from_partner, seconds=seconds,
         erasure={lv: {str(k): v for k, v in per.items()} for lv, per in plan.erasure.items()})
    return None


def _foreign_world(every: list[dict[str, Any]], committed: list[int], world: int,
                   where: Any) -> tuple[set[int], CheckpointError | None]:
    """Committed steps written by another world size (never used, never overwritten while
    nothing else is usable) and the error that names the newest of them."""
    foreign: dict[int, int] = {}
    for step in committed:
        worlds = {v["w"] for inv in every for s, v in inv.items()
                  if int(s) == step and v.get("w") is not None}
        other = sorted(w for w in worlds if w != world)
        if other:
            foreign[step] = other[0]
    if not foreign:
        return set(), None
    step = max(foreign)
    return set(foreign), CheckpointError(step, {}, message=(
        f"the committed step {step} under {where} was written by a job of {foreign[step]} "
        f"ranks, and this job has {world}; relaunch with {foreign[step]} ranks (or use "
        f"another FTKIT_JOB, or a PFS level to reshard from); nothing was modified"))


def load(dc: DistComm, levels: Levels, faults: Faults, step: int,
         state: MutableMapping[str, Any]) -> None:
    """Load this rank's shard of ``step`` into ``state``; the same error everywhere on
    failure. All ranks call."""
    def _load() -> None:
        faults.fire("restore-load", step)
        with levels.local.open_shard(step) as shard:
            leaves = leaves_of(shard.header)
            tensors = [leaf_from_bytes(leaf, shard.raw(i).copy())
                       for i, leaf in enumerate(leaves)]
            tree = unflatten(shard.header["tree"], tensors)
        if not isinstance(tree, dict):
            raise CheckpointError(step, {}, message=f"{shard.path}: state root is not a dict")
        load_into(state, tree, step)
    dc.run(_load, "restore-load", step)
