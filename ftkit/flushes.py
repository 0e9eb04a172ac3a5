"""One rank's PFS flushes: the flush thread, back-pressure and failures (docs/protocol.md,
"A failed flush is a warning" and "Back-pressure: training never waits for a flush").

The :class:`~ftkit.checkpointer.Checkpointer` owns one :class:`Flushes`. After every commit
its checkpoint thread calls :meth:`Flushes.schedule` with the step when it is due at ``pfs``
and the vote's ``flush_busy`` flag (the same on every rank), so every rank starts, delays or
skips the same flushes in the same order: each flush is a collective of its own
(``PfsLevel.flush``), run on the flush thread when the checkpointer is asynchronous.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
from collections.abc import Callable
from typing import Any

from ftkit.comm import flag
from ftkit.comm.dist import describe
from ftkit.errors import ProtocolTimeout
from ftkit.storage.pfs.early import EarlyWrite
from ftkit.storage.pfs.level import PfsLevel
from ftkit.storage.slots import Reservation

log = logging.getLogger("ftkit.checkpointer")     # the checkpointer's log: users filter on it


class Flushes:
    """Flushes of committed steps to ``pfs`` (None: no PFS level; nothing is ever due).

    ``emit(event, **fields)`` appends an event (rank 0), ``abort(why)`` ends the world (a
    peer lost during a flush), ``patience()`` bounds a local wait for an earlier flush,
    ``background``: flush on a thread of its own, else on the caller's. ``wait_mode``:
    ``FTKIT_PFS_BACKPRESSURE=wait`` (the next flush waits for the previous one)."""

    def __init__(self, pfs: PfsLevel | None, *, rank: int, emit: Callable[..., None],
                 abort: Callable[[str], None], patience: Callable[[], float],
                 background: bool, wait_mode: bool) -> None:
        self.pfs, self.rank = pfs, rank
        self._emit, self._abort, self._patience = emit, abort, patience
        self._wait_mode = wait_mode
        self._thread = cf.ThreadPoolExecutor(1, thread_name_prefix="ftkit-flush") \
            if background and pfs is not None else None
        self._futures: collections.deque[cf.Future[None]] = collections.deque()
        self._early_pool: cf.ThreadPoolExecutor | None = None
        self._early: EarlyWrite | None = None   # the newest capture's early write
        self._shut = False                      # shutdown() was called: no new early write
        self.kept: set[int] = set()             # being flushed or delayed: retention keeps them
        self.delayed: int | None = None         # committed step whose flush waits its turn
        self.failures: dict[int, str] = {}      # step -> why its PFS flush failed (agreed)
        self.last_flushed: int | None = None    # newest step flushed to / restored from PFS

    def busy(self) -> bool:
        """This rank's previous flush is still running (polled for the vote; never with
        ``wait_mode``, where the next flush waits for it instead). Local."""
        return not self._wait_mode and self._running()

    def _running(self) -> bool:
        """A flush of this rank is still running. Local."""
        pending = list(self._futures)        # one atomic copy: the training thread pops
        return any(not f.done() for f in pending)

    def write_early(self, step: int, res: Reservation) -> None:
        """The capture of ``step``, due at ``pfs``, fills the slot ``res``: start its early
        write (``PfsLevel.write_early``) when no flush of this rank is running (else the
        flush writes the file after the commit, as always). Adopted by the flush of
        ``step`` when it starts right after the commit, else discarded
        (:meth:`discard_early`). Local (checkpoint or training thread)."""
        self.discard_early()
        if self.pfs is None or self._shut or self._running():
            return
        if self._early_pool is None:
            self._early_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="ftkit-early")
        try:
            self._early = self.pfs.write_early(step, res, self._early_pool, self._patience())
        except Exception as exc:  # noqa: BLE001 - the flush writes the file itself then
            log.warning("rank %d: no early PFS write of step %d: %s", self.rank, step,
                        describe(exc))

    def discard_early(self) -> None:
        """Give up the early write no flush took (the step was not committed, or its flush
        was delayed or skipped). Local."""
        early, self._early = self._early, None
        if early is not None:
            early.discard()

    def schedule(self, due: int | None, busy: bool) -> None:
        """Back-pressure, after a commit (checkpoint thread). ``due``: the committed step
        when it is due at ``pfs``; ``busy``: the vote found a flush still running on some
        rank (the same on every rank, so every rank decides alike). Training never waits
        for a flush: a due step whose flush would have to wait is *delayed* (kept
        node-local) and flushed after the first commit that finds every flush finished, or
        at :meth:`finish`; a newer due step *skips* the one still delayed. Events
        ``flush-delayed`` / ``flush-skipped``."""
        if due is not None and self.delayed is not None:
            self._emit("flush-skipped", step=self.delayed, superseded_by=due)
            self.kept.discard(self.delayed)
            self.delayed = None
        if busy:
            if due is not None:
                self.delayed = due
                self.kept.add(due)             # retention keeps it until it is flushed
                self._emit("flush-delayed", step=due,
                           reason="the previous PFS flush is still running")
            return
        step = due if due is not None else self.delayed
        self.delayed = None
        if step is not None:
            self._start(step)

    def forget_done(self) -> None:
        """Drop the flushes that finished (their outcome is recorded already). Local."""
        while self._futures and self._futures[0].done():
            self._futures.popleft()

    def finish(self, result: Callable[[cf.Future[None], str], None]) -> None:
        """Wait for every flush, then flush a delayed step (its turn now) and wait for it,
        and for the deletion of the steps retention retired. ``result(future, what)``
        waits for one (aborting the world past its patience). All ranks call at the same
        point."""
        self._drain(result)
        if self.delayed is not None:
            step, self.delayed = self.delayed, None
            self._start(step)
            self._drain(result)
        if self.pfs is not None:
            self.pfs.settle()                  # rank 0: retired steps' files are gone

    def flush_last(self, step: int | None, result: Callable[[cf.Future[None], str], None]
                   ) -> None:
        """At ``close()``: flush committed ``step`` when it is not on the PFS (it was not due
        there), so a finished job's final state outlives its nodes, and wait for it. Not a
        step whose flush failed (its failure is reported). All ranks call at the same point
        (``step`` and the flush outcomes are the same on every rank)."""
        if self.pfs is None or step is None or step in self.failures or (
                self.last_flushed is not None and self.last_flushed >= step):
            return
        self._start(step)
        self._drain(result)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the flush thread (after :meth:`finish`; ``wait=False``: let a flush in
        progress end on its own, as an abandoned one does under in-job recovery). Local."""
        self._shut = True
        self.discard_early()
        if self._thread is not None:
            self._thread.shutdown(wait=wait)
        if self._early_pool is not None:
            self._early_pool.shutdown(wait=wait)

    def unflushed(self) -> dict[str, Any] | None:
        """``{"step", "why", "last_flushed"}`` of the newest failed PFS flush when no later
        step reached the PFS (the newest committed steps are only node-local), else None.
        Local."""
        failed = [s for s in self.failures
                  if self.last_flushed is None or s > self.last_flushed]
        if not failed:
            return None
        step = max(failed)
        return {"step": step, "why": self.failures[step], "last_flushed": self.last_flushed}

    def report_unflushed(self, last_committed: int | None) -> None:
        """Rank 0, at close: an ERROR when the newest PFS flush attempted failed, so the
        newest committed step is only on the node-local levels."""
        lost = self.unflushed()
        if self.rank != 0 or lost is None:
            return
        on_pfs = (f"the newest step on the PFS is {self.last_flushed}"
                  if self.last_flushed is not None else "no step reached the PFS in this attempt")
        log.error("committed step %s is only on the node-local levels: the PFS flush of step "
                  "%d failed (%s); %s. A relaunch on the same nodes resumes from the node-local "
                  "levels; if those nodes are lost, from the PFS", last_committed, lost["step"],
                  lost["why"], on_pfs)

    # --------------------------------------------------------------- internals
    def _drain(self, result: Callable[[cf.Future[None], str], None]) -> None:
        while self._futures:
            result(self._futures.popleft(), "PFS flush")

    def _start(self, step: int) -> None:
        """Flush committed ``step``: on the flush thread when there is one, else right here.
        The previous flush has finished (:meth:`schedule`), or, in ``wait_mode``, this
        (checkpoint) thread waits for it here."""
        early = self._take_early(step)
        if self._thread is None:
            self._flush(step, early)
            return
        for older in list(self._futures):
            flag.wait_done(older, self._patience(), f"the PFS flush before step {step}")
        self.kept.add(step)
        self._futures.append(self._thread.submit(self._flush, step, early))

    def _take_early(self, step: int) -> EarlyWrite | None:
        """The early write of ``step``, handed to its flush (None: there is none)."""
        if self._early is None or self._early.step != step:
            return None
        early, self._early = self._early, None
        return early

    def _flush(self, step: int, early: EarlyWrite | None = None) -> None:
        """``PfsLevel.flush`` agrees its outcome, so every rank sees the same failure; a
        failure degrades the job (:meth:`_failed`), it is never raised. A ProtocolTimeout
        (a rank lost or hung) is failure detection, not a PFS failure: it aborts the
        world."""
        assert self.pfs is not None
        try:
            seconds = self.pfs.flush(step, early_write=early)
        except ProtocolTimeout as exc:
            self._abort(str(exc))
            raise
        except Exception as exc:  # noqa: BLE001 - the PFS copy is lost; training goes on
            if _echo_of_a_lost_peer(exc):
                log.info("PFS flush of step %d abandoned: a peer rank failed (%s); in-job "
                         "recovery", step, flag.reason())
                return
            self._failed(step, describe(exc))
            return
        finally:
            self.kept.discard(step)
        self.last_flushed = step
        self._emit("flush", step=step, seconds=round(seconds, 6),
                   dir=str(self.pfs.step_dir(step)), removed=self.pfs.pruned)

    def _failed(self, step: int, reason: str) -> None:
        """Every rank: keep the agreed ``reason`` in ``failures`` and log it once (rank 0 at
        WARNING, the others at INFO); rank 0 appends a ``flush-failed`` event. The level
        stays on: the next step due at ``pfs`` is flushed as usual."""
        self.failures[step] = reason
        log.log(logging.WARNING if self.rank == 0 else logging.INFO,
                "PFS flush of step %d failed; training continues on the node-local levels "
                "and the next step due at pfs is flushed as usual: %s", step, reason)
        self._emit("flush-failed", step=step, level="pfs", reason=reason)


def _echo_of_a_lost_peer(exc: BaseException) -> bool:
    """Under in-job recovery, is the flush's error only the echo of a peer's death (a
    ``PeerLost``, or an MPI error while the watcher confirms a failure within
    ``CONFIRM_S``)? Then it is failure detection, not a PFS failure: the recovery takes
    over, and no ``flush-failed`` is recorded for a file system that did nothing wrong."""
    if not flag.active():
        return False
    if flag.tripped() or isinstance(exc, flag.PeerLost):
        return True
    from mpi4py import MPI
    return isinstance(exc, MPI.Exception) and flag.confirm()
