"""Restore the newest step that is committed and recoverable on every rank (docs/protocol.md).

Phases: ``restore-discover`` (ranks exchange inventories over MPI; for each committed step,
newest first, every rank checks what it holds (own shard, partner copies, parity) by their
headers, and a :mod:`plan <ftkit.recovery.plan>` says whether lost shards can be rebuilt;
a load or rebuild that fails looks at the step again, every byte), ``restore-rebuild`` (partner copies / XOR / RS decoding
over MPI, see :mod:`ftkit.recovery.rebuild`), ``restore-load`` (each tensor read straight into
the live state, verified as it lands; a failure looks at the step again, every byte, so
redundancy can repair it). A rank only reads its own node's directory; everything from
another node travels over MPI.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ftkit.capture import attached
from ftkit.capture.apply import load_into, mismatch_text, structure_diff
from ftkit.capture.devicecopy import DeviceLanding
from ftkit.capture.flatten import DecodeError
from ftkit.capture.inplace import Reading, live_leaves, plan_reading
from ftkit.capture.shards import ShardSpec, cut_difference, header_table
from ftkit.comm.dist import DistComm, describe
from ftkit.errors import (
    CheckpointError,
    CorruptCheckpointError,
    StateMismatchError,
    UnrecoverableError,
    one_line,
)
from ftkit.faults import Faults
from ftkit.recovery import peerload, rebuild
from ftkit.recovery.plan import Plan, make_plan
from ftkit.recovery.sharedload import entry_dests, exchange
from ftkit.storage.level import Report
from ftkit.storage.levels import Levels
from ftkit.storage.local import LocalLevel
from ftkit.storage.pfs.retention import remove_steps
from ftkit.storage.shard import Shard, tree_leaves

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
    verify: set[int] = dataclasses.field(default_factory=set)
    # steps discovery checks every byte of (a load or a rebuild of them failed once); the
    # others only by their headers: loading and rebuilding verify the bytes they use
    sources: peerload.Sources = dataclasses.field(default_factory=dict)
    # lost ranks of ``step`` that load straight from redundancy -> where from (a rank, a set)
    repair: peerload.Repair | None = None
    # what ``step`` is owed once loaded with streamed shards: them on disk, re-protection
    nbytes: int = 0                 # tensor bytes of this rank's shard, once loaded

    def loaded_from(self) -> dict[str, Any]:
        """Lost rank (a string) -> where its shard was loaded from: the rank whose copy it
        received, or the erasure set it was decoded from."""
        return {str(r): where for r, where in self.sources.items()}

    def unusable(self) -> dict[int, str]:
        """Every committed step on the node-local levels that cannot be used, with why."""
        return dict(sorted({**self.skipped, **self.excluded}.items(), reverse=True))


class Restorer:
    """The restore over the node-local levels of one rank: discover the newest step every
    rank can load (rebuilding lost shards where a redundancy level allows), then load it.
    Holds what every step of it needs: the communicator, the levels, the fault hooks and
    the event sink. Its public methods are collectives: all ranks call them."""

    def __init__(self, dc: DistComm, levels: Levels, faults: Faults,
                 emit: Callable[..., None]) -> None:
        self.dc, self.levels, self.faults, self.emit = dc, levels, faults, emit

    def discover(self, *, run_id: str | None = None, rank_node: list[int] | None = None,
                 layout: dict[str, int] | None = None) -> Discovery:
        """Agree on the newest committed step every rank can load, rebuilding lost shards when
        a redundancy level allows. Steps whose COMMITTED record names another world size,
        another DP x TP x PP ``layout`` or another run are excluded (see :class:`Discovery`;
        the PFS level reshards); a step saved with another rank to node map is tried like
        any other, and its reason says how the map differs. Nothing is deleted here. All
        ranks call."""
        dc, local = self.dc, self.levels.local
        self.faults.fire("restore-discover", None)
        mine = {"node": local.root.name, "steps": _inventory(local)}
        gathered = dc.allgather(mine, "restore-discover")
        nodes = [g["node"] for g in gathered]
        every = [g["steps"] for g in gathered]
        committed = sorted({int(s) for inv in every for s, v in inv.items() if v["c"]},
                           reverse=True)
        excluded = _other_identity(every, committed, dc.size, run_id, local.root.parent, layout)
        committed = [s for s in committed if s not in excluded]
        levels_of = {s: sorted({lv for inv in every for lv in inv.get(str(s), {}).get("levels", [])})
                     or ["local"] for s in committed}
        found = Discovery(0, committed, {}, levels_of, excluded=excluded, nodes=nodes,
                          inventories=every, rank_node=rank_node)
        self._scan(found, committed)
        return found

    def try_load(self, found: Discovery, state: MutableMapping[str, Any]) -> bool:
        """Load ``found.step`` into ``state``. Every rank decodes its shard's header into a
        tree whose tensors are the live tensors that can take their bytes in place
        (:mod:`ftkit.capture.inplace`) or new buffers; once every rank's state is agreed to fit
        (else the same StateMismatchError everywhere: an older step would not fit either), each
        tensor is read into its destination in one pass, its checksum computed as the bytes
        land, and the rest is loaded into ``state``. *Any* failure to read, decode or verify on
        any rank makes the step unusable everywhere (one-line reason per rank in
        ``found.skipped``, the log and a ``restore-skip`` event), discovery goes on with the
        older committed steps and False is returned: ``found.step`` then names the next usable
        step (0: none). Nothing is deleted. True once loaded.

        A checksum that fails while reading can leave some live tensors overwritten: the caller
        then loads an older step or a PFS step over all of them, or raises (a skipped step makes
        a restore that finds nothing else an :class:`UnrecoverableError`), so ``state`` is never
        returned half old, half new. All ranks call."""
        fetch = peerload.Fetch(self.levels, found.step, found.repair)
        loaded = False
        try:
            loaded = self._load(found, state, fetch)
        finally:
            fetch.finish(loaded)
        return loaded

    def _load(self, found: Discovery, state: MutableMapping[str, Any],
              fetch: peerload.Fetch) -> bool:
        """:meth:`try_load` with ``fetch``: what this rank streams to lost ranks, and its own
        shard streamed from redundancy when it was lost. All ranks call."""
        dc, step = self.dc, found.step
        reading: Reading | None = None
        with contextlib.ExitStack() as stack:
            failure = None
            try:
                fetch.post()                  # first: a lost rank waits on these
                self.faults.fire("restore-load", step)
                remote = fetch.open(dc.size)
                shard = stack.enter_context(remote if remote is not None
                                            else self.levels.local.open_shard(step))
                reading = _plan_reading(shard, dc.rank, step, state)
                found.nbytes = sum(t["nbytes"] for t in shard.tensors)
            except Exception as exc:  # noqa: BLE001 - agreed below: the step is unusable
                failure = one_line(exc)
            if not self._agreed_loadable(found, step, failure):
                return False
            assert reading is not None
            check_fits(dc, state, reading.tree, step)     # nothing is written unless all fit
            try:
                entries = dataclasses.replace(reading, dests=entry_dests(shard, reading))
                _read_checked(shard, entries, dc.rank, step)
            except Exception as exc:  # noqa: BLE001 - agreed below: the step is unusable
                failure = one_line(exc)
            if not self._agreed_loadable(found, step, failure):
                return False
            try:                   # the slices of a shared shard kept by other replicas
                exchange(dc, shard, reading, step)
            except Exception as exc:  # noqa: BLE001 - agreed below: the step is unusable
                failure = one_line(exc)
            if not self._agreed_loadable(found, step, failure):
                return False
        load_agreed(dc, state, reading.tree, step)
        return True

    def start_fresh(self, pfs_dir: Path, rank_node: Sequence[int], run_id: str, *,
                    leader: bool) -> None:
        """``FTKIT_START=fresh``: delete this job's checkpoints on every level (node
        leaders their node's directory, rank 0 the PFS steps under ``pfs_dir``), as the
        user asked. All ranks call."""
        local, dc = self.levels.local, self.dc
        removed = local.remove_all() if leader else []
        # PFS steps go even when this run has no PFS level: a later run with one would
        # otherwise resume the old timeline from them
        pfs_removed = remove_steps(pfs_dir) if dc.rank == 0 else []
        gathered = dc.allgather(removed, "restore-discover")   # also: all removed
        log.warning("rank %d: FTKIT_START=fresh: removed node-local steps %s, PFS steps %s",
                    dc.rank, removed, pfs_removed)
        self.emit("fresh-start", local={str(rank_node[r]): g for r, g in enumerate(gathered)
                                        if g}, pfs=pfs_removed, run=run_id)

    def _scan(self, found: Discovery, steps: list[int]) -> None:
        """Set ``found.step`` to the first of ``steps`` (newest first) that every rank holds
        intact or can rebuild; record every step before it in ``found.skipped``. All ranks
        call."""
        found.sources, found.repair = {}, None
        for step in steps:
            plan, reports = self._plan_step(found, step)
            if plan.ok:
                found.step = step
                return
            failures = {r: rep["own"] for r, rep in enumerate(reports) if rep["own"] is not None}
            named = "".join(f" (rank {r}: {f})" for r, f in list(failures.items())[:4])
            self._skip(found, step, failures, str(plan.unrecoverable) + named
                       + _layout_note(found.inventories, step, found.rank_node))

    def _plan_step(self, found: Discovery, step: int) -> tuple[Plan, list[Report]]:
        """Gather every rank's report of ``step``, plan, and rebuild what is lost; a rebuild
        that fails (a copy or parity damaged: discovery read headers only) makes discovery look
        at the step again with every byte, once. Returns the plan and the reports. All ranks
        call."""
        dc, levels = self.dc, self.levels
        while True:
            report = rebuild.local_report(levels, step, dc.size, found.levels_of[step],
                                          data=step in found.verify)
            reports = dc.allgather(report, "restore-discover", step)
            plan = make_plan(step, reports, found.levels_of[step], levels.covers(), found.nodes)
            sources = peerload.sources(plan, levels.covers(), reports) if plan.ok else None
            if sources and step not in found.verify:     # streamed at the load, repaired after
                found.sources = sources
                found.repair = peerload.Repair(plan, reports, found.levels_of[step])
                return plan, reports
            if plan.ok and plan.lost:
                plan.unrecoverable = self._try_rebuild(plan, reports, found.levels_of[step],
                                                       found.nodes)
                if not plan.ok and step not in found.verify:
                    if dc.rank == 0:
                        log.warning("restore: %s; looking at step %d again, every byte",
                                    plan.unrecoverable, step)
                    found.verify.add(step)
                    continue
            return plan, reports

    def _skip(self, found: Discovery, step: int, failures: dict[int, str], reason: str) -> None:
        """Record that committed ``step`` is unusable (the same on every rank): in
        ``found.skipped``, the log (rank 0) and a ``restore-skip`` event. All ranks call."""
        found.skipped[step] = reason
        if self.dc.rank == 0:
            detail = "; ".join(f"rank {r}: {f}" for r, f in failures.items())
            log.warning("restore: committed step %d is unusable, trying an older one: %s. %s",
                        step, detail or "no shard lost", reason)
        self.emit("restore-skip", step=step, failures=failures, reason=reason)

    def _try_rebuild(self, plan: Plan, reports: list[Report], step_levels: list[str],
                     nodes: list[str]) -> str | None:
        t0 = time.monotonic()
        try:
            again = rebuild.execute(self.dc, self.levels, self.faults, plan, reports,
                                    step_levels)
        except CheckpointError as exc:
            return f"rebuild of step {plan.step} failed: {exc}"
        self._rebuilt(plan, again, time.monotonic() - t0, nodes)
        return None

    def _rebuilt(self, plan: Plan, again: list[str], seconds: float, nodes: list[str],
                 **extra: Any) -> None:
        """Log (rank 0) and report the rebuild of ``plan`` (a ``rebuild`` event). All ranks
        call."""
        lost_nodes = sorted({nodes[r] for r in plan.lost})
        if self.dc.rank == 0:
            log.warning("restore: step %d: rebuilt the shards of ranks %s (lost on %s) from %s",
                        plan.step, plan.lost, ", ".join(lost_nodes), "; ".join(plan.how()))
        self.emit("rebuild", step=plan.step, ranks=plan.lost, nodes=lost_nodes,
                  from_partner=plan.from_partner, seconds=round(seconds, 6),
                  erasure={lv: {str(k): v for k, v in per.items()}
                           for lv, per in plan.erasure.items()},
                  by_level=plan.parts, reprotected=again, **extra)

    def repair(self, found: Discovery) -> None:
        """After ``found.step`` was loaded with lost shards streamed from redundancy:
        write those shards into their node-local slots from the same copies or parity and
        re-protect the step (:func:`ftkit.recovery.rebuild.execute`), then report it (a
        ``rebuild`` event with ``loaded_from``: lost rank -> where it streamed from). A failure
        is logged and reported (``repair-failed``), never raised: the step was loaded, and
        the next committed step is protected whole. Does nothing when nothing is owed.
        All ranks call (on the checkpoint thread when saves are asynchronous)."""
        job, found.repair = found.repair, None
        if job is None:
            return
        t0 = time.monotonic()
        try:
            again = rebuild.execute(self.dc, self.levels, self.faults, job.plan, job.reports,
                                    job.step_levels)
        except CheckpointError as exc:
            if self.dc.rank == 0:
                log.warning("restore: step %d was loaded, but rebuilding its lost shards on "
                            "their nodes failed (the step stays protected as the failure "
                            "left it; the next save protects a newer one): %s",
                            job.plan.step, one_line(exc))
            self.emit("repair-failed", step=job.plan.step, ranks=job.plan.lost,
                      reason=one_line(exc))
            return
        self._rebuilt(job.plan, again, time.monotonic() - t0, found.nodes,
                      loaded_from=found.loaded_from())

    def _agreed_loadable(self, found: Discovery, step: int, failure: str | None) -> bool:
        """Agree whether every rank could read ``step``; if not, skip it and rescan the older
        committed steps (``found.step``: the next usable one, 0 when none). All ranks call."""
        if failure is not None:
            log.warning("rank %d: cannot load step %d: %s", self.dc.rank, step, failure)
        failures = self.dc.agree(failure, "restore-load", step)
        if not failures:
            return True
        if step not in found.verify:
            # discovery read no tensor byte: look at the step again, every byte of every
            # rank's shard, so a damaged shard is rebuilt from redundancy where the levels
            # allow (the caller then loads it again), else the step is skipped with the reason
            found.verify.add(step)
            found.step = 0
            self._scan(found, [s for s in found.committed if s <= step])
            return False
        reason = f"step {step} could not be loaded: " + "; ".join(
            f"rank {r}: {f}" for r, f in failures.items())
        self._skip(found, step, failures, reason if len(reason) <= 1000 else reason[:997] + "...")
        found.step = 0
        self._scan(found, [s for s in found.committed if s < step])
        return False


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


def _other_identity(every: list[dict[str, Any]], committed: list[int], world: int,
                    run_id: str | None, where: Any, layout: dict[str, int] | None = None
                    ) -> dict[int, str]:
    """Committed steps written by another world size, layout or run, with why (never
    used, never overwritten while nothing else is usable)."""
    out: dict[int, str] = {}
    for step in committed:
        recs = [v for inv in every for s, v in inv.items() if int(s) == step]
        worlds = sorted({v["w"] for v in recs if v.get("w") is not None and v["w"] != world})
        runs = sorted({v["run"] for v in recs
                       if run_id and v.get("run") is not None and v["run"] != run_id})
        layouts = [v["layout"] for v in recs if layout and v.get("layout") is not None
                   and v["layout"] != layout]
        if worlds:
            out[step] = (f"written by a job of {worlds[0]} ranks under {where}, and this job "
                         f"has {world}; relaunch with {worlds[0]} ranks (or use another "
                         f"FTKIT_JOB, or a PFS level to reshard from)")
        elif layouts:
            out[step] = (f"written with layout {_layout_text(layouts[0])} under {where}, and "
                         f"this job runs {_layout_text(layout or {})}: node-local shards hold "
                         f"that layout's pieces (a PFS level reshards)")
        elif runs:
            out[step] = (f"belongs to another run ({runs[0]}) of job {Path(str(where)).name} "
                         f"under {where}; this run is {run_id} (its identity is kept in the "
                         f"job's PFS directory): another run's checkpoint is never resumed")
    return out


def _layout_text(layout: dict[str, int]) -> str:
    return " ".join(f"{k}{layout.get(k)}" for k in ("dp", "tp", "pp"))


def _plan_reading(shard: Shard, rank: int, step: int, state: Any) -> Reading:
    """The destinations of ``shard``'s tensors (:func:`ftkit.capture.inplace.plan_reading`)
    and the tree over them, nothing read yet. CorruptCheckpointError naming the file when
    the tree does not decode; ValueError when the shard holds other pieces of its global
    tensors than the live state (:func:`ftkit.capture.shards.cut_difference`: loading them
    in place would put them in the wrong place). Local."""
    try:
        leaves = tree_leaves(shard.header)
        reading = plan_reading(leaves, shard.header["tree"], state)
    except DecodeError as exc:
        raise CorruptCheckpointError(str(shard.path), str(exc), rank=rank, step=step) \
            from None
    specs = header_table(shard.header, "shards")
    saved = {t.path: ShardSpec.from_json(specs[str(i)]) if str(i) in specs else None
             for i, t in enumerate(leaves)}
    why = cut_difference(saved, state, live_leaves(state, attached.extra_layout))
    if why is not None:
        raise ValueError(f"step {step} was saved with another cut: {why} (DTensor placements "
                         f"or declared shards changed; a PFS level reshards)")
    return reading


def _read_checked(shard: Shard, reading: Reading, rank: int, step: int) -> None:
    """Read every tensor of ``shard`` into its destination, each checked against its
    checksum on the bytes read (:meth:`Shard.read_into`). CorruptCheckpointError naming the
    file and the tensor on a mismatch. Local."""
    landing = DeviceLanding()
    try:
        for i, dest in enumerate(reading.dests):
            if isinstance(dest, np.ndarray):
                ok = shard.read_into(i, dest)
            else:                         # a GPU tensor: through a reused pinned buffer
                landing.start(dest)
                ok = shard.read_through(i, landing)
            if not ok:
                raise CorruptCheckpointError(
                    str(shard.path), f"checksum mismatch in tensor "
                    f"{shard.tensors[i]['path']} while loading", rank=rank, step=step)
    finally:
        landing.finish()


def apply_agreed(dc: DistComm, state: MutableMapping[str, Any], tree: dict[str, Any],
                 step: int) -> None:
    """Check the restored ``tree`` against the live ``state`` (structure: names, shapes,
    dtypes) on every rank, then load it. Raises the same StateMismatchError everywhere when
    any rank's state differs, the same CheckpointError when loading fails. All ranks call."""
    check_fits(dc, state, tree, step)
    load_agreed(dc, state, tree, step)


def check_fits(dc: DistComm, state: MutableMapping[str, Any], tree: dict[str, Any],
               step: int) -> None:
    """The same StateMismatchError on every rank when any rank's live ``state`` differs in
    structure (names, shapes, dtypes) from its ``tree``. All ranks call."""
    try:
        diffs = structure_diff(state, tree)
    except Exception as exc:  # noqa: BLE001 - agreed below, like any difference
        diffs = [f"cannot compare with the checkpoint: {one_line(exc)}"]
    mismatch = dc.agree(f"state differs from the checkpoint: {mismatch_text(diffs)}"
                        if diffs else None, "restore-load", step)
    if mismatch:
        raise _mismatch(step, mismatch)


def load_agreed(dc: DistComm, state: MutableMapping[str, Any], tree: dict[str, Any],
                step: int) -> None:
    """Load ``tree`` into ``state`` on every rank (:func:`load_into`); the same
    StateMismatchError everywhere when an object refuses it, the same CheckpointError when
    loading fails otherwise. All ranks call."""
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
    if failures:
        raise _mismatch(step, failures)


def _mismatch(step: int, mismatch: dict[int, str]) -> StateMismatchError:
    return StateMismatchError(step, mismatch, message=(
        f"the state passed to restore does not match the checkpoint of step {step} "
        f"(another model or configuration?); nothing was deleted"))
