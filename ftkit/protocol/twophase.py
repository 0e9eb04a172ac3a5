"""One coordinated checkpoint: write-local, encode, vote, decide, commit (docs/protocol.md).

Every rank runs :meth:`TwoPhase.run` for the same step, in the same order (it is a collective
over ``dc``). A failure on any rank before the vote makes that rank vote *no*; the
coordinator (rank 0) durably records a *commit* decision before announcing it; every rank
then makes the step permanent, or discards it on *abort*. A final exchange makes every rank
raise the same :class:`CheckpointError` when anything failed anywhere.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ftkit.capture.flatten import TensorLeaf
from ftkit.capture.staging import Staging, TornSnapshotError
from ftkit.comm.dist import DistComm, describe
from ftkit.errors import CheckpointError, ProtocolTimeout
from ftkit.faults import Faults
from ftkit.storage.level import Level

log = logging.getLogger(__name__)
COORDINATOR = 0


@dataclasses.dataclass
class Snapshot:
    """What ``capture`` produced on one rank for one step (or why it could not)."""

    step: int
    levels: tuple[str, ...]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    tree: Any = None
    leaves: list[TensorLeaf] = dataclasses.field(default_factory=list)
    buffers: list[np.ndarray] = dataclasses.field(default_factory=list)
    failure: str | None = None
    captured_at: float = dataclasses.field(default_factory=time.time)
    staging: Staging | None = None     # background part of capture, if any
    into: Any = None                   # the reserved slot the capture fills (a Reservation)


@dataclasses.dataclass
class Outcome:
    """Result of one checkpoint, identical on every rank."""

    step: int
    committed: bool
    failures: dict[int, str]
    seconds: float
    stop: bool = False       # the coordinator saw a stop request (time limit near)
    flush_busy: bool = False  # some rank's previous PFS flush was still running at the vote


class ProtocolMismatch(CheckpointError):
    """Ranks ran the protocol for different steps: a rank skipped a ``save`` the others made
    (or called ``close()`` while they saved). A program error a relaunch meets again."""

    recurs = True


#: the step ``close()`` announces in :meth:`TwoPhase.check_in_step`: no save pending here
CLOSING = 2 ** 62


def out_of_step(steps: Sequence[int]) -> str:
    """One line naming the ranks that did not call the lowest ``save`` of ``steps`` (one
    per rank) and what each called instead."""
    first = min(steps)
    called = [r for r, s in enumerate(steps) if s == first]
    others = [(r, s) for r, s in enumerate(steps) if s != first]
    what = ", ".join(f"rank {r} called {'close()' if s == CLOSING else f'save({s})'}"
                     for r, s in others[:8]) + (" ..." if len(others) > 8 else "")
    return (f"rank{'s' if len(others) > 1 else ''} {_ranks([r for r, _ in others])} did not "
            f"call save({first}) ({what} while rank{'s' if len(called) > 1 else ''} "
            f"{_ranks(called)} called save({first})): every rank must call save() with the "
            f"same steps")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8
                                             else "")


class TwoPhase:
    """Runs the protocol for one rank. ``before_write`` is called by every rank right before
    its tentative shard is written (the checkpointer uses it for retention). ``identity`` is
    added to every COMMITTED record (run id, layout, rank to node map). PFS flushes are not
    part of a protocol run: their outcome is agreed inside ``PfsLevel.flush`` and never
    raised (docs/protocol.md, "A failed flush is a warning")."""

    def __init__(self, dc: DistComm, levels: dict[str, Level], faults: Faults,
                 before_write: Callable[[int], None], emit: Callable[..., None],
                 stop_requested: Callable[[], bool] = lambda: False,
                 identity: dict[str, Any] | None = None,
                 flush_busy: Callable[[], bool] = lambda: False) -> None:
        self.dc = dc
        self.identity = identity or {}
        self.stop_requested = stop_requested   # polled by the coordinator in ``decide``
        self.flush_busy = flush_busy           # polled by every rank for its vote
        self.levels = levels
        self.faults = faults
        self.before_write = before_write
        self.emit = emit   # emit(event, **fields): events.jsonl on the coordinator

    def run(self, snap: Snapshot) -> Outcome:
        """Run phases write-local .. commit for ``snap.step``. All ranks call.

        Every vote and the decision carry the step; a vote or decision for another step means
        the ranks ran their protocols out of step, which no decision can repair: the run
        raises :class:`ProtocolMismatch` (the checkpointer aborts the world)."""
        t0 = time.monotonic()
        step = snap.step
        failure = self._local(snap)
        try:
            self.faults.fire("vote", step)
        except Exception as exc:  # noqa: BLE001 - a failing voter votes no
            failure = failure or describe(exc)
        votes, busy = self._votes(step, failure)
        decision = self._decide(step, votes, snap.levels) if votes is not None else None
        if decision is not None:
            self.faults.fire("announce", step)
        decision = self._announce(step, decision)
        if decision.get("step") != step:
            raise ProtocolMismatch(step, {self.dc.rank: (
                f"the coordinator decided on step {decision.get('step')} while this rank "
                f"runs the protocol of step {step}")},
                message=f"protocol runs out of step at step {step}")
        late = self._finish(step, decision, snap.levels)
        late_failures = self.dc.agree(late, "commit", step)
        failures = {int(r): f for r, f in decision["failures"].items()} | late_failures
        out = Outcome(step, decision["commit"], failures, time.monotonic() - t0,
                      stop=bool(decision.get("stop")), flush_busy=busy)
        if self.dc.rank == COORDINATOR:
            self.emit("commit" if out.committed else "abort", step=step,
                      seconds=round(out.seconds, 6), failures=failures, levels=list(snap.levels))
        return out

    def exchange(self, step: int, failure: str | None, phase: str, busy: bool = False
                 ) -> tuple[bool, bool]:
        """One fixed-size allreduce: (whether any rank fails, whether any is busy), checking
        that every rank is at ``step``. The first collective of every protocol run (the
        ``encode`` agreement, else the vote) and of ``close()`` (``step`` =
        :data:`CLOSING`) is one: a rank that skipped a save meets its peers here. Raises the
        same :class:`ProtocolMismatch` on every rank, naming the ranks that skipped a save,
        when they are at different steps. All ranks call."""
        no, low, high, busy_ = self.dc.allreduce_max(
            [failure is not None, -step, step, busy], phase, step)
        if -low != high:
            steps = self.dc.allgather(step, phase, step)
            raise ProtocolMismatch(min(steps), {}, message=out_of_step(steps))
        return bool(no), bool(busy_)

    def _votes(self, step: int, failure: str | None
               ) -> tuple[list[dict[str, Any]] | None, bool]:
        """(every rank's vote at the coordinator, None elsewhere; whether any rank's PFS
        flush is still running — the same on every rank). One fixed-size allreduce says
        whether any rank votes no, runs another step or is still flushing; only when one
        votes no or runs another step are the votes themselves gathered. All ranks call."""
        no, busy = self.exchange(step, failure, "vote", self.flush_busy())
        if no:
            return self.dc.gather({"step": step, "failure": failure}, "vote", step,
                                  root=COORDINATOR), bool(busy)
        if self.dc.rank != COORDINATOR:
            return None, bool(busy)
        return [{"step": step, "failure": None}] * self.dc.size, bool(busy)

    def _announce(self, step: int, decision: dict[str, Any] | None) -> dict[str, Any]:
        """Broadcast the coordinator's decision: one fixed-size message (step, commit, stop,
        whether there are failures), then the failures only when there are some. All ranks
        call; only the coordinator passes its decision."""
        head = [0, 0, 0, 0] if decision is None else [
            decision["step"], decision["commit"], decision["stop"], bool(decision["failures"])]
        step_, commit, stop, failed = self.dc.bcast_ints(head, "decide", step,
                                                         root=COORDINATOR)
        failures = self.dc.bcast(None if decision is None else decision["failures"],
                                 "decide", step, root=COORDINATOR) if failed else {}
        return {"step": step_, "commit": bool(commit), "stop": bool(stop),
                "failures": failures}

    def record(self, step: int, levels: Sequence[str]) -> dict[str, Any]:
        """This job's COMMITTED record of ``step``."""
        return commit_record(step, self.dc.size, levels, **self.identity)

    def _local(self, snap: Snapshot) -> str | None:
        """Phases write-local and encode on this rank; returns a failure or None.

        Encoding is collective, so when redundancy levels are due every rank first learns
        whether all writes succeeded; if one failed, nobody encodes (everyone votes on)."""
        step = snap.step
        failure = snap.failure
        if failure is None:
            failure = self._guard(lambda: self._write(snap), step)
        redundant = [name for name in snap.levels if name != "local" and name in self.levels]
        if not redundant:
            return failure
        if failure is None:
            failure = self._guard(lambda: self._before_encode(step), step)
        if self.exchange(step, failure, "encode")[0]:
            return failure
        return self._guard(lambda: self._encode(step, redundant), step)

    def _before_encode(self, step: int) -> None:
        """The ``encode`` fault point. The shard is not re-read here: damage between write
        and encode is still never spread to other nodes, because each level verifies what
        it encodes in the pass that encodes it (a partner copy byte by byte on its receiver,
        which votes no; XOR/RS parity from the own shard checked in the pass that folds and
        checksums it, so every member of the set refuses to write parity)."""
        self.faults.fire("encode", step)

    def _encode(self, step: int, names: list[str]) -> None:
        for name in names:
            self.levels[name].encode(step)   # collective over the level's communicator

    def _write(self, snap: Snapshot) -> None:
        self.faults.fire("write-local", snap.step)
        self.before_write(snap.step)
        for name in (n for n in snap.levels if n in self.levels):
            self.levels[name].write_tentative(snap.step, snap.meta, snap.tree, snap.leaves,
                                              snap.buffers)

    def _guard(self, fn: Callable[[], object], step: int) -> str | None:
        """Run fn; a failure becomes this rank's "no" vote (logged), never a missed collective."""
        try:
            fn()
        except ProtocolTimeout:
            raise
        except Exception as exc:  # noqa: BLE001 - reported through the vote
            log.error("rank %d: step %d failed before the vote: %s", self.dc.rank, step,
                      describe(exc))
            return describe(exc)
        return None

    def _decide(self, step: int, votes: list[dict[str, Any]], levels: tuple[str, ...]
                ) -> dict[str, Any]:
        """Coordinator: decide, record a commit durably, then return the announcement."""
        failures = {r: v["failure"] for r, v in enumerate(votes) if v["failure"] is not None}
        for r, v in enumerate(votes):
            if v["step"] != step:
                failures[r] = f"voted for step {v['step']} in the protocol of step {step}"
        commit = not failures
        try:
            self.faults.fire("decide", step)
            if commit:
                for level in self.levels.values():
                    level.record_commit(step, self.record(step, levels))
        except Exception as exc:  # noqa: BLE001 - no durable record: abort
            failures[self.dc.rank] = describe(exc)
            commit = False
        return {"step": step, "commit": commit, "failures": failures,
                "stop": self.stop_requested()}

    def _finish(self, step: int, decision: dict[str, Any], levels: tuple[str, ...]
                ) -> str | None:
        """Phase commit on this rank; returns a late failure or None."""
        try:
            if self.dc.rank != COORDINATOR:
                self.faults.fire("decide", step)
            self.faults.fire("commit", step)
            record = self.record(step, levels)
            for level in (self.levels[name] for name in levels if name in self.levels):
                if decision["commit"]:
                    level.commit(step, record)
                else:
                    level.discard(step)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            return describe(exc)
        return None


def commit_record(step: int, world: int, levels: Sequence[str], **extra: Any
                  ) -> dict[str, Any]:
    """The content of a COMMITTED record (read back by restore: world size and levels)."""
    return {"step": step, "decision": "commit", "time": time.time(), "world": world,
            "levels": list(levels), **extra}


def raise_if_failed(out: Outcome) -> None:
    """Raise the same CheckpointError on every rank if ``out`` reports failures."""
    if out.failures:
        state = "committed, but" if out.committed else "aborted;"
        error = CheckpointError(out.step, out.failures, message=(
            f"checkpoint of step {out.step} {state} failures"))
        # a torn snapshot is the program's doing: relaunched, it tears the same tensor again
        error.recurs = all(f.startswith(f"{TornSnapshotError.__name__}: ")
                           for f in out.failures.values())
        raise error
