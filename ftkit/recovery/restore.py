"""Restore the newest step that is committed and recoverable on every rank (docs/protocol.md).

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
from pathlib import Path
from typing import Any

from ftkit import passes
from ftkit.capture.apply import load_into, mismatch_text, structure_diff
from ftkit.capture.flatten import DecodeError, leaf_from_bytes, unflatten
from ftkit.comm.dist import DistComm, describe
from ftkit.errors import (
    CheckpointError,
    CorruptCheckpointError,
    StateMismatchError,
    UnrecoverableError,
)
from ftkit.recovery import rebuild
from ftkit.recovery.plan import make_plan, one_line
from ftkit.storage.levels import Levels
from ftkit.storage.local import LocalLevel
from ftkit.storage.shard import checksum, leaves_of
from ftkit.testing.faults import Faults

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Discovery:
    """Result of discovery, identical on every rank."""

    step: int                       # 0 when nothing usable is committed
    committed: list[int]            # steps of this run and world committed somewhere, newest first
    skipped: dict[int, str]         # step -> why it was not usable
    levels_of: dict[int, list[str]]  # step -> levels it was saved with
    excluded: dict[int, str] = dataclasses.field(default_factory=dict)
    # committed steps of another world size or another run: never used, never overwritten
    nodes: list[str] = dataclasses.field(default_factory=list, repr=False)
    # node directory name of every rank
    inventories: list[dict[str, Any]] = dataclasses.field(default_factory=list, repr=False)
    # every rank's listing of its node's steps and their COMMITTED records
    rank_node: list[int] | None = None              # this job's rank -> node map

    def unusable(self) -> dict[int, str]:
        """Every committed step on the node-local levels that cannot be used, with why."""
        return dict(sorted({**self.skipped, **self.excluded}.items(), reverse=True))


def discover(dc: DistComm, levels: Levels, faults: Faults, emit: Callable[..., None], *,
             run_id: str | None = None, rank_node: list[int] | None = None) -> Discovery:
    """Agree on the newest committed step every rank can load, rebuilding lost shards when
    a redundancy level allows. Steps whose COMMITTED record names another world size or
    another run are excluded (see :class:`Discovery`); a step saved with another rank to
    node map is tried like any other, and its reason says how the map differs. Nothing is
    deleted here. All ranks call."""
    faults.fire("restore-discover", None)
    local = levels.local
    mine = {"node": local.root.name, "steps": _inventory(local)}
    gathered = dc.allgather(mine, "restore-discover")
    nodes = [g["node"] for g in gathered]
    every = [g["steps"] for g in gathered]
    committed = sorted({int(s) for inv in every for s, v in inv.items() if v["c"]},
                       reverse=True)
    excluded = _other_identity(every, committed, dc.size, run_id, local.root.parent)
    committed = [s for s in committed if s not in excluded]
    levels_of = {s: sorted({lv for inv in every for lv in inv.get(str(s), {}).get("levels", [])})
                 or ["local"] for s in committed}
    found = Discovery(0, committed, {}, levels_of, excluded=excluded, nodes=nodes,
                      inventories=every, rank_node=rank_node)
    _scan(dc, levels, faults, emit, found, committed)
    return found


def _inventory(local: LocalLevel) -> dict[str, dict[str, Any]]:
    """This node's steps and what their COMMITTED records say (a record that cannot be read
    counts as one that says nothing). Local; never raises."""
    try:
        steps = local.inventory()
    except Exception as exc:  # noqa: BLE001 - a node that cannot list its steps has none
        log.warning("restore: cannot list %s: %s", local.root, one_line(exc))
        return {}
    out = {}
    for s, v in steps.items():
        try:
            info = local.record_info(s)
        except Exception as exc:  # noqa: BLE001 - an unreadable record says nothing
            log.warning("restore: cannot read the record of step %d in %s: %s", s,
                        local.root, one_line(exc))
            info = {"w": None, "levels": [], "run": None, "nodes": None}
        out[str(s)] = {"c": v["committed"], **info}
    return out


def _scan(dc: DistComm, levels: Levels, faults: Faults, emit: Callable[..., None],
          found: Discovery, steps: list[int]) -> None:
    """Set ``found.step`` to the first of ``steps`` (newest first) that every rank holds
    intact or can rebuild; record every step before it in ``found.skipped``. All ranks
    call."""
    for step in steps:
        reports = dc.allgather(rebuild.local_report(levels, step, dc.size, found.levels_of[step]),
                               "restore-discover", step)
        plan = make_plan(step, reports, found.levels_of[step], levels.partners, levels.sets,
                         levels.parity, found.nodes)
        if plan.ok and plan.lost:
            plan.unrecoverable = _try_rebuild(dc, levels, faults, plan, reports,
                                              found.levels_of[step], emit, found.nodes)
        if plan.ok:
            found.step = step
            return
        failures = {r: rep["own"] for r, rep in enumerate(reports) if rep["own"] is not None}
        _skip(dc, found, step, failures, str(plan.unrecoverable)
              + _layout_note(found.inventories, step, found.rank_node), emit)


def _skip(dc: DistComm, found: Discovery, step: int, failures: dict[int, str], reason: str,
          emit: Callable[..., None]) -> None:
    """Record that committed ``step`` is unusable (the same on every rank): in
    ``found.skipped``, the log (rank 0) and a ``restore-skip`` event. All ranks call."""
    found.skipped[step] = reason
    if dc.rank == 0:
        detail = "; ".join(f"rank {r}: {f}" for r, f in failures.items())
        log.warning("restore: committed step %d is unusable, trying an older one: %s. %s",
                    step, detail or "no shard lost", reason)
    emit("restore-skip", step=step, failures=failures, reason=reason)


def _layout_note(every: list[dict[str, Any]], step: int, now: list[int] | None) -> str:
    """Why a layout change may explain a lost shard: the rank to node map in the step's
    COMMITTED record versus this job's (empty when equal or unknown)."""
    saved = next((v["nodes"] for inv in every for s, v in inv.items()
                  if int(s) == step and v.get("nodes") is not None), None)
    if saved is None or now is None or list(saved) == list(now):
        return ""
    return (f" (the step was saved with rank->node map {_nodes_text(saved)}, this job runs "
            f"with {_nodes_text(now)}: a rank reads only its own node's directory, so shards "
            f"left on other nodes cannot be found)")


def _nodes_text(rank_node: list[int]) -> str:
    return "[" + ", ".join(f"{r}:node-{n}" for r, n in enumerate(rank_node)) + "]"


def unrecoverable_error(found: Discovery, where: Any, pfs_unusable: dict[int, str]
                        ) -> UnrecoverableError:
    """The error restore raises when committed steps exist but none can be used."""
    local = "; ".join(f"step {s} (levels {','.join(found.levels_of.get(s, ['local']))}): "
                      f"{why}" for s, why in found.unusable().items())
    pfs = "; ".join(f"PFS step {s}: {why}" for s, why in sorted(pfs_unusable.items(),
                                                                 reverse=True))
    return UnrecoverableError(
        f"restore: committed checkpoints exist under {where} but none can be used: "
        + "; ".join(x for x in (local, pfs) if x)
        + ". Nothing was deleted. To start this job over, relaunch with `ftkit run --fresh` "
          "(or FTKIT_START=fresh), or remove its checkpoints with `ftkit clean <job>`")


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


def _other_identity(every: list[dict[str, Any]], committed: list[int], world: int,
                    run_id: str | None, where: Any) -> dict[int, str]:
    """Committed steps written by another world size or another run, with why (never
    used, never overwritten while nothing else is usable)."""
    out: dict[int, str] = {}
    for step in committed:
        recs = [v for inv in every for s, v in inv.items() if int(s) == step]
        worlds = sorted({v["w"] for v in recs if v.get("w") is not None and v["w"] != world})
        runs = sorted({v["run"] for v in recs
                       if run_id and v.get("run") is not None and v["run"] != run_id})
        if worlds:
            out[step] = (f"written by a job of {worlds[0]} ranks under {where}, and this job "
                         f"has {world}; relaunch with {worlds[0]} ranks (or use another "
                         f"FTKIT_JOB, or a PFS level to reshard from)")
        elif runs:
            out[step] = (f"belongs to another run ({runs[0]}) of job {Path(str(where)).name} "
                         f"under {where}; this run is {run_id} (its identity is kept in the "
                         f"job's PFS directory): another run's checkpoint is never resumed")
    return out


def try_load(dc: DistComm, levels: Levels, faults: Faults, found: Discovery,
             state: MutableMapping[str, Any], emit: Callable[..., None]) -> bool:
    """Load ``found.step`` into ``state``. Every rank reads and decodes its shard, verifying
    each tensor's checksum on the bytes it loads; *any* failure of that on any rank makes
    the step unusable everywhere (one-line reason per rank in ``found.skipped``, the log
    and a ``restore-skip`` event), discovery goes on with the older committed steps and
    False is returned: ``found.step`` then names the next usable step (0: none). Nothing is
    deleted. True once loaded. A live state that does not fit the checkpoint raises the
    same StateMismatchError everywhere (an older step would not fit either). All ranks
    call."""
    step = found.step
    tree: dict[str, Any] = {}
    failure = None
    try:
        tree = _read_tree(levels, faults, dc.rank, step)
    except Exception as exc:  # noqa: BLE001 - agreed below: the step is unusable
        failure = one_line(exc)
        log.warning("rank %d: cannot load step %d: %s", dc.rank, step, failure)
    failures = dc.agree(failure, "restore-load", step)
    if failures:
        reason = f"step {step} could not be loaded: " + "; ".join(
            f"rank {r}: {f}" for r, f in failures.items())
        _skip(dc, found, step, failures,
              reason if len(reason) <= 1000 else reason[:997] + "...", emit)
        found.step = 0
        _scan(dc, levels, faults, emit, found, [s for s in found.committed if s < step])
        return False
    apply_agreed(dc, state, tree, step)
    return True


def load(dc: DistComm, levels: Levels, faults: Faults, step: int,
         state: MutableMapping[str, Any]) -> None:
    """Load this rank's shard of ``step`` into ``state`` like :func:`try_load`, but a read
    or decode failure is the same CheckpointError everywhere instead of a fallback. All
    ranks call."""
    tree = dc.run(lambda: _read_tree(levels, faults, dc.rank, step), "restore-load", step)
    apply_agreed(dc, state, tree, step)


def _read_tree(levels: Levels, faults: Faults, rank: int, step: int) -> dict[str, Any]:
    """This rank's state tree of ``step``, every tensor's checksum verified on the bytes it
    loads (copies). CorruptCheckpointError naming the file when a tensor or the tree does
    not check out or decode. Local."""
    faults.fire("restore-load", step)
    with levels.local.open_shard(step) as shard:
        def bad(reason: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(str(shard.path), reason, rank=rank, step=step)
        try:
            tensors = []
            for i, leaf in enumerate(leaves_of(shard.header)):
                data = shard.raw(i).copy()
                passes.count("copy", data.nbytes)
                if checksum(data) != shard.tensors[i]["checksum"]:
                    raise bad(f"checksum mismatch in tensor {leaf.path} while loading")
                tensors.append(leaf_from_bytes(leaf, data))
            tree = unflatten(shard.header["tree"], tensors)
        except DecodeError as exc:
            raise bad(str(exc)) from None
        if not isinstance(tree, dict):
            raise bad(f"the state root is a {type(tree).__name__}, not a dict")
    return tree


def apply_agreed(dc: DistComm, state: MutableMapping[str, Any], tree: dict[str, Any],
                 step: int) -> None:
    """Check the restored ``tree`` against the live ``state`` (structure: names, shapes,
    dtypes) on every rank, then load it. Raises the same StateMismatchError everywhere when
    any rank's state differs, the same CheckpointError when loading fails. All ranks call."""
    try:
        diffs = structure_diff(state, tree)
    except Exception as exc:  # noqa: BLE001 - agreed below, like any difference
        diffs = [f"cannot compare with the checkpoint: {one_line(exc)}"]
    mismatch = dc.agree(f"state differs from the checkpoint: {mismatch_text(diffs)}"
                        if diffs else None, "restore-load", step)
    if not mismatch:          # nothing is loaded anywhere unless every rank's state fits
        failure, refused = None, False
        try:
            load_into(state, tree, step)
        except StateMismatchError as exc:
            failure, refused = str(exc), True
        except Exception as exc:  # noqa: BLE001 - agreed below
            failure = describe(exc)
        got = dc.allgather([failure, refused], "restore-load", step)
        failures = {r: f for r, (f, _) in enumerate(got) if f is not None}
        if failures and not any(x for _, x in got):
            raise CheckpointError(step, failures, message=f"phase 'restore-load' of step "
                                                          f"{step} failed")
        mismatch = failures
    if mismatch:
        raise StateMismatchError(step, mismatch, message=(
            f"the state passed to restore does not match the checkpoint of step {step} "
            f"(another model or configuration?); nothing was deleted"))
