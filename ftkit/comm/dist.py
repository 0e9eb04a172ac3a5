"""Exception-robust collectives with deadlines ("abort, don't hang").

Every method of :class:`DistComm` is a collective over its communicator: **all ranks of the
communicator must call it, in the same order**. Each one is built on non-blocking MPI
operations polled against a deadline, so a rank that died or hangs turns into a
:class:`~ftkit.errors.ProtocolTimeout` on the others instead of a silent hang. Small control
messages travel as JSON bytes (never pickle).

Bulk transfers (shards, parity) get a deadline that grows with their size,
:meth:`DistComm.bulk_deadline`: ``FTKIT_TIMEOUT`` plus the bytes at
:data:`MIN_BULK_BANDWIDTH`, so a large state on a slow link is not mistaken for a dead peer.
Their point-to-point messages use :meth:`DistComm.bulk_tag` (fresh tags per transfer) and,
on error, :meth:`DistComm.release` (cancel, or keep the buffers alive until MPI is done), so
a failed transfer never leaves a receive or a send that a later transfer could match.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from mpi4py import MPI

from ftkit import passes
from ftkit.comm import flag as injob
from ftkit.errors import CheckpointError, ProtocolTimeout
from ftkit.jobdir.fatal import record_death, recurs
from ftkit.progress import MIN_BULK_BANDWIDTH, NoProgress, bulk_seconds

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Bulk tags start here (tags below are left to other users of the communicator).
TAG_FLOOR = 1 << 10
#: Transfers between one pair of ranks for one step before their tags repeat.
TAG_ORDINALS = 16
_TAG_KEYS_KEPT = 4096
class DistComm:
    """A duplicated communicator whose collectives honour a timeout and agree on failures."""

    def __init__(self, comm: MPI.Comm, timeout: float, *, dup: bool = True) -> None:
        self.comm = comm.Dup() if dup else comm
        self.timeout = timeout
        self.generation = injob.generation()      # in-job recovery: see waitall
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self._tag_uses: dict[tuple[int, int, int], int] = {}
        self._orphans: list[tuple[list[MPI.Request], list[Any]]] = []
        tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        self._tag_slots = (int(tag_ub or 32767) - TAG_FLOOR + 1) // TAG_ORDINALS

    # ---------------------------------------------------------------- plumbing
    def wait(self, req: MPI.Request, phase: str, step: int | None, *,
             allow_bytes: int | None = None) -> None:
        """Poll ``req`` until it completes or the deadline passes (then raise). With
        ``allow_bytes`` the deadline is :meth:`bulk_deadline` of that many bytes (a peer is
        still doing bulk I/O, e.g. writing its file), polled without spinning."""
        self.waitall([req], phase, step, nbytes=allow_bytes, spin=False)

    def waitall(self, reqs: list[MPI.Request], phase: str, step: int | None, *,
                spin: bool | None = None, nbytes: int | None = None) -> None:
        """Poll ``reqs`` until all complete or the deadline passes (then raise).

        The deadline is ``FTKIT_TIMEOUT``, or :meth:`bulk_deadline` of ``nbytes`` for a bulk
        transfer. Non-blocking MPI operations progress only inside MPI calls, so bulk
        transfers (``spin=True``; by default when ``nbytes`` is given) poll back to back,
        yielding the CPU in between; small control messages (and ``spin=False``: a long wait
        for another rank's I/O) back off to millisecond sleeps. On a timeout the requests are
        left as they are: see :meth:`waitall_bulk` for transfers. Under in-job recovery a
        known failure of a peer ends the wait at once (:class:`~ftkit.comm.flag.PeerLost`),
        as does any wait on a communicator of an earlier generation (abandoned threads)."""
        clock = self.deadline(nbytes)
        spin = nbytes is not None if spin is None else spin
        pause = 0.0
        while reqs and not MPI.Request.Testall(reqs):
            injob.check(f"phase {phase!r} of step {step}", self.generation)
            if clock.expired():
                raise self.timeout_error(phase, step, nbytes=nbytes)
            time.sleep(pause)
            if not spin:
                pause = min(0.005, pause + 0.0002)

    def waitall_bulk(self, reqs: list[MPI.Request], phase: str, step: int | None,
                     nbytes: int, keep: Sequence[Any], *, cancel: bool = True) -> None:
        """:meth:`waitall` for a bulk transfer of ``nbytes``; on any error the requests are
        released (:meth:`release`, ``keep``: their buffers) before the error propagates.
        ``cancel=False`` for non-blocking collectives (which cannot be cancelled)."""
        try:
            self.waitall(reqs, phase, step, nbytes=nbytes)
        except BaseException:
            self.release(reqs, keep, cancel=cancel)
            raise

    def deadline(self, nbytes: int | None = None) -> NoProgress:
        """The clock of one wait on this communicator, started now: ``FTKIT_TIMEOUT``, or
        :meth:`bulk_deadline` of ``nbytes`` for a bulk transfer (local)."""
        limit = self.timeout if nbytes is None else self.bulk_deadline(nbytes)
        return NoProgress(limit, clock=time.monotonic)

    def bulk_deadline(self, nbytes: int) -> float:
        """Seconds a bulk transfer of ``nbytes`` may take before it is an error:
        ``FTKIT_TIMEOUT + nbytes / MIN_BULK_BANDWIDTH`` (local, pure)."""
        return bulk_seconds(self.timeout, nbytes)

    def timeout_error(self, phase: str, step: int | None, *,
                      nbytes: int | None = None) -> ProtocolTimeout:
        """The error of a phase that missed its deadline on this rank."""
        if nbytes is None:
            limit = f"{self.timeout:g} s (FTKIT_TIMEOUT)"
        else:
            limit = (f"{self.bulk_deadline(nbytes):g} s (FTKIT_TIMEOUT {self.timeout:g} s + "
                     f"{nbytes} bytes at {MIN_BULK_BANDWIDTH / 1e6:g} MB/s)")
        return ProtocolTimeout(
            step if step is not None else -1,
            {self.rank: f"phase {phase!r} did not complete within {limit}; a peer rank is "
                        f"dead or hung"},
            message=f"timeout in phase {phase!r} of step {step}")

    # ----------------------------------------------------- point-to-point bulk hygiene
    def bulk_tag(self, step: int, src: int, dst: int) -> int:
        """A fresh tag for one bulk transfer from rank ``src`` to rank ``dst`` of this
        communicator for ``step``. Local, but both ends must call it once per transfer (the
        sender with ``src`` = itself, the receiver with ``dst`` = itself): the tag follows
        from the step and how many transfers between the pair this rank started for that
        step, so both compute the same one, and the messages of an earlier transfer that
        failed (a send MPI could not cancel) never match a later one. Tags repeat after
        :data:`TAG_ORDINALS` transfers of one pair in one step, or for steps that are a
        multiple of ``(TAG_UB - TAG_FLOOR + 1) / TAG_ORDINALS`` apart (134 million with
        Open MPI)."""
        key = (step, src, dst)
        n = self._tag_uses.pop(key, 0)
        self._tag_uses[key] = n + 1          # most recently used last
        if len(self._tag_uses) > _TAG_KEYS_KEPT:
            del self._tag_uses[next(iter(self._tag_uses))]
        return TAG_FLOOR + (step % self._tag_slots) * TAG_ORDINALS + n % TAG_ORDINALS

    def release(self, reqs: Sequence[MPI.Request], keep: Sequence[Any] = (), *,
                cancel: bool = True) -> None:
        """After an error: cancel the point-to-point requests of ``reqs`` still pending and
        complete the cancellations. MPI may be unable to cancel some (a send that is already
        matched, or any send under Open MPI): those, and their buffers ``keep``, are kept
        here and reaped by later calls once MPI is done with them, so no buffer is unmapped
        or reused under a pending operation. Local call."""
        live = [r for r in reqs if r]
        if cancel:
            for req in live:
                with contextlib.suppress(MPI.Exception):
                    req.Cancel()
        grace = time.monotonic() + 0.05         # a cancelled receive completes at once
        while live:
            live = [r for r in live if not _test(r)]
            if not live or time.monotonic() > grace:
                break
            time.sleep(0)
        if live:
            log.debug("rank %d: %d request(s) could not be cancelled; kept until done",
                      self.rank, len(live))
            self._orphans.append((live, list(keep)))
        self.reap()

    def reap(self) -> int:
        """Forget orphaned requests that completed; returns how many are still pending."""
        alive = []
        for reqs, keep in self._orphans:
            reqs = [r for r in reqs if not _test(r)]
            if reqs:
                alive.append((reqs, keep))
        self._orphans = alive
        return sum(len(r) for r, _ in alive)

    # -------------------------------------------------------------- collectives
    def split(self, color: int, key: int) -> DistComm:
        """A DistComm over the ranks with the same ``color`` (same timeout). All ranks call."""
        return DistComm(self.comm.Split(color, key), self.timeout, dup=False)

    def barrier(self, phase: str, step: int | None = None) -> None:
        """Barrier with deadline. All ranks call."""
        self.wait(self.comm.Ibarrier(), phase, step)
        passes.collective(0)

    def allreduce_max(self, values: Sequence[int], phase: str, step: int | None = None, *,
                      allow_bytes: int | None = None) -> list[int]:
        """Element-wise maximum of a fixed-size vector of integers over all ranks (one
        ``Iallreduce``: O(log P) rounds, O(1) bytes). All ranks call with the same length.
        ``allow_bytes``: see :meth:`wait`."""
        send = np.asarray(values, dtype=np.int64)
        recv = np.empty_like(send)
        self.wait(self.comm.Iallreduce([send, MPI.INT64_T], [recv, MPI.INT64_T], op=MPI.MAX),
                  phase, step, allow_bytes=allow_bytes)
        passes.collective(recv.nbytes)
        return [int(v) for v in recv]

    def bcast_ints(self, values: Sequence[int], phase: str, step: int | None = None,
                   root: int = 0) -> list[int]:
        """Broadcast a fixed-size vector of integers from ``root`` (one ``Ibcast``). All
        ranks call with the same length (only root's values matter)."""
        buf = np.asarray(values, dtype=np.int64).copy()
        self.wait(self.comm.Ibcast([buf, MPI.INT64_T], root=root), phase, step)
        passes.collective(buf.nbytes)
        return [int(v) for v in buf]

    def allgather(self, obj: Any, phase: str, step: int | None = None) -> list[Any]:
        """Gather one JSON-serialisable object from every rank to every rank. All ranks call."""
        data = json.dumps(obj).encode()
        counts = [0] * self.size
        lens = bytearray(8 * self.size)
        self.wait(self.comm.Iallgather([len(data).to_bytes(8, "little"), MPI.BYTE],
                                       [lens, MPI.BYTE]), phase, step)
        counts = [int.from_bytes(lens[8 * i:8 * i + 8], "little") for i in range(self.size)]
        displs = [sum(counts[:i]) for i in range(self.size)]
        recv = bytearray(sum(counts))
        self.wait(self.comm.Iallgatherv([data, MPI.BYTE], [recv, counts, displs, MPI.BYTE]),
                  phase, step)
        passes.collective(len(lens) + len(recv), rounds=2)
        return [json.loads(recv[d:d + c]) for d, c in zip(displs, counts)]

    def gather(self, obj: Any, phase: str, step: int | None = None, root: int = 0
               ) -> list[Any] | None:
        """Gather one JSON object per rank at ``root`` (others get None). All ranks call."""
        data = json.dumps(obj).encode()
        lens = bytearray(8 * self.size) if self.rank == root else None
        self.wait(self.comm.Igather([len(data).to_bytes(8, "little"), MPI.BYTE],
                                    [lens, MPI.BYTE] if lens is not None else None, root=root),
                  phase, step)
        if lens is None:
            self.wait(self.comm.Igatherv([data, MPI.BYTE], None, root=root), phase, step)
            passes.collective(0, rounds=2)
            return None
        counts = [int.from_bytes(lens[8 * i:8 * i + 8], "little") for i in range(self.size)]
        displs = [sum(counts[:i]) for i in range(self.size)]
        recv = bytearray(sum(counts))
        self.wait(self.comm.Igatherv([data, MPI.BYTE], [recv, counts, displs, MPI.BYTE],
                                     root=root), phase, step)
        passes.collective(len(lens) + len(recv), rounds=2)
        return [json.loads(recv[d:d + c]) for d, c in zip(displs, counts)]

    def bcast(self, obj: Any, phase: str, step: int | None = None, root: int = 0) -> Any:
        """Broadcast one JSON object from ``root``. All ranks call."""
        data = json.dumps(obj).encode() if self.rank == root else b""
        size = bytearray(len(data).to_bytes(8, "little"))
        self.wait(self.comm.Ibcast([size, MPI.BYTE], root=root), phase, step)
        buf = bytearray(data) if self.rank == root else bytearray(int.from_bytes(size, "little"))
        self.wait(self.comm.Ibcast([buf, MPI.BYTE], root=root), phase, step)
        passes.collective(len(size) + len(buf), rounds=2)
        return json.loads(buf)

    def agree(self, failure: str | None, phase: str, step: int, *,
              allow_bytes: int | None = None) -> dict[int, str]:
        """Exchange local failures; every rank returns the same ``{rank: failure}``. All call.
        One fixed-size :meth:`allreduce_max` of a failure flag; the failures themselves are
        gathered (:meth:`allgather`) only when some rank failed. ``allow_bytes``: the bulk
        I/O the slowest rank may still be doing before it gets here (see :meth:`wait`)."""
        if not self.allreduce_max([failure is not None], phase, step,
                                  allow_bytes=allow_bytes)[0]:
            return {}
        got = self.allgather(failure, phase, step)
        return {r: f for r, f in enumerate(got) if f is not None}

    def run(self, fn: Callable[[], T], phase: str, step: int) -> T:
        """Run ``fn`` on every rank; if it fails anywhere, raise the same CheckpointError
        everywhere. All ranks call (the collective is entered even when ``fn`` raised)."""
        result: T | None = None
        failure: str | None = None
        try:
            result = fn()
        except Exception as exc:
            failure = describe(exc)
            log.debug("phase %s step %d failed locally", phase, step, exc_info=True)
        failures = self.agree(failure, phase, step)
        if failures:
            raise CheckpointError(step, failures, message=f"phase {phase!r} of step {step} failed")
        return result  # type: ignore[return-value]

    def free(self) -> None:
        """Release the duplicated communicator (local, no communication)."""
        if self.comm != MPI.COMM_NULL and self.comm != MPI.COMM_WORLD:
            try:
                self.comm.Free()
            except MPI.Exception:
                pass


def _test(req: MPI.Request) -> bool:
    """True when ``req`` completed (or is unusable); never raises."""
    try:
        return bool(req.Test())
    except MPI.Exception:
        return True


def describe(exc: BaseException) -> str:
    """One-line description of an exception for failure reports."""
    return f"{type(exc).__name__}: {exc}"


_hooks_installed = False
#: how a communication library (gloo, NCCL, sockets) says that a peer process went away
_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "remote process exited")
#: seconds a rank that failed only because a peer vanished waits before it aborts the job:
#: the launcher reports the first death it sees, and it should be the peer's
LOST_PEER_GRACE = 2.0


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` only says that another process of the job went away (pure)."""
    text = str(exc)
    return isinstance(exc, (RuntimeError, OSError)) and any(s in text for s in _LOST_PEER)


def _debugging() -> bool:
    return (log.isEnabledFor(logging.DEBUG)
            or os.environ.get("FTKIT_LOG_LEVEL", "").strip().upper() == "DEBUG")


#: preloaded by a rank's forkserver: it dies with the rank (see that module)
_CHILD_GUARD = "ftkit.launch.childguard"


def keep_children_out_of_mpi() -> None:
    """A child process that imports this rank's script again (a DataLoader worker started
    with ``spawn`` or ``forkserver``, Python 3.14's default on Linux) runs its top-level
    ``from mpi4py import MPI``, which would initialise MPI in a process no launcher knows
    (the worker or the job's exit hangs). Once this rank's MPI is up,
    ``MPI4PY_RC_INITIALIZE=0`` in its environment makes such an import leave MPI alone (a
    child that wants MPI calls ``MPI.Init()`` itself; a value already set is kept). And a
    forkserver this rank starts preloads :mod:`ftkit.launch.childguard`, so that it and its
    workers do not outlive a killed rank. Local."""
    if not MPI.Is_initialized():
        return
    os.environ.setdefault("MPI4PY_RC_INITIALIZE", "0")
    from multiprocessing import forkserver
    preload = list(getattr(forkserver._forkserver, "_preload_modules", ["__main__"]))
    if _CHILD_GUARD not in preload:
        forkserver.set_forkserver_preload([_CHILD_GUARD, *preload])


def install_abort_hooks() -> None:
    """Make an uncaught exception in any thread abort the MPI world instead of hanging it.

    Equivalent to running under ``python -m mpi4py``; installed by :meth:`Topology.create`.
    Local call, idempotent.

    Only the process that installed them acts on them. A process forked from a rank (a
    DataLoader worker, anything of ``multiprocessing`` with the fork start method) inherits
    the hooks but is no MPI process: calling ``MPI_Abort`` there hangs it, and the launcher,
    which waits for the rank's output pipes that the child still holds, hangs with it. Such a
    child gets Python's own hooks back at the fork, and a hook that still reaches one (a
    reference taken before the fork, as ``multiprocessing.resource_sharer`` calls
    ``sys.excepthook``) passes the exception on to them.
    """
    global _hooks_installed
    if _hooks_installed or MPI.COMM_WORLD.Get_size() == 1:
        return
    _hooks_installed = True
    previous, previous_thread = sys.excepthook, threading.excepthook
    owner = os.getpid()

    def _abort(kind: str, exc_type: Any, exc: Any, tb: Any) -> None:
        rank = MPI.COMM_WORLD.Get_rank()
        if kind != "main thread" and injob.active() and (
                isinstance(exc, injob.PeerLost) or injob.confirm()):
            # the echo of a peer's death in a helper thread: in-job recovery handles it
            log.info("rank %d: %s ended after a peer failed: %s", rank, kind, exc)
            return
        if recurs(exc) and not _debugging():
            # a configuration or checkpoint error: its message says it all, no traceback
            sys.stderr.write(f"ftkit: rank {rank}: {type(exc).__name__}: {exc}\n")
        else:
            sys.stderr.write(f"ftkit: uncaught exception in {kind} on rank {rank}; "
                             f"aborting the MPI job\n")
            traceback.print_exception(exc_type, exc, tb)
        sys.stderr.flush()
        record_death(MPI.COMM_WORLD.Get_rank(), exc)     # for ftkit run's attempt line
        if lost_peer(exc):
            # a consequence, not the cause: let the launcher see the peer's death first
            time.sleep(LOST_PEER_GRACE)
        MPI.COMM_WORLD.Abort(1)

    def excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
        if issubclass(exc_type, KeyboardInterrupt) or os.getpid() != owner:
            previous(exc_type, exc, tb)
            return
        _abort("main thread", exc_type, exc, tb)

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if os.getpid() != owner:
            previous_thread(args)
            return
        _abort(f"thread {args.thread.name if args.thread else '?'}",
               args.exc_type, args.exc_value, args.exc_traceback)

    def in_child() -> None:
        if sys.excepthook is excepthook:
            sys.excepthook = previous
        if threading.excepthook is thread_hook:
            threading.excepthook = previous_thread

    sys.excepthook = excepthook
    threading.excepthook = thread_hook
    os.register_at_fork(after_in_child=in_child)
