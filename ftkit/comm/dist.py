"""Exception-robust collectives with deadlines ("abort, don't hang").

Every method of :class:`DistComm` is a collective over its communicator: **all ranks of the
communicator must call it, in the same order**. Each one is built on non-blocking MPI
operations polled against a deadline, so a rank that died or hangs turns into a
:class:`~ftkit.errors.ProtocolTimeout` on the others instead of a silent hang. Small control
messages travel as JSON bytes (never pickle).
"""
from __future__ import annotations

import json
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from mpi4py import MPI

from ftkit.errors import CheckpointError, ProtocolTimeout

log = logging.getLogger(__name__)
T = TypeVar("T")


class DistComm:
    """A duplicated communicator whose collectives honour a timeout and agree on failures."""

    def __init__(self, comm: MPI.Comm, timeout: float, *, dup: bool = True) -> None:
        self.comm = comm.Dup() if dup else comm
        self.timeout = timeout
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()

    # ---------------------------------------------------------------- plumbing
    def wait(self, req: MPI.Request, phase: str, step: int | None) -> None:
        """Poll ``req`` until it completes or the deadline passes (then raise)."""
        self.waitall([req], phase, step)

    def waitall(self, reqs: list[MPI.Request], phase: str, step: int | None, *,
                spin: bool = False) -> None:
        """Poll ``reqs`` until all complete or the deadline passes (then raise).

        Non-blocking MPI operations progress only inside MPI calls, so bulk transfers
        (``spin=True``) poll back to back, yielding the CPU in between; small control
        messages back off to millisecond sleeps."""
        deadline = time.monotonic() + self.timeout
        pause = 0.0
        while reqs and not MPI.Request.Testall(reqs):
            if time.monotonic() > deadline:
                raise self.timeout_error(phase, step)
            time.sleep(pause)
            if not spin:
                pause = min(0.005, pause + 0.0002)

    def timeout_error(self, phase: str, step: int | None) -> ProtocolTimeout:
        """The error of a phase that missed its deadline on this rank."""
        return ProtocolTimeout(
            step if step is not None else -1,
            {self.rank: f"phase {phase!r} did not complete within {self.timeout:g} s "
                        f"(FTKIT_TIMEOUT); a peer rank is dead or hung"},
            message=f"timeout in phase {phase!r} of step {step}")

    # -------------------------------------------------------------- collectives
    def split(self, color: int, key: int) -> DistComm:
        """A DistComm over the ranks with the same ``color`` (same timeout). All ranks call."""
        return DistComm(self.comm.Split(color, key), self.timeout, dup=False)

    def barrier(self, phase: str, step: int | None = None) -> None:
        """Barrier with deadline. All ranks call."""
        self.wait(self.comm.Ibarrier(), phase, step)

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
            return None
        counts = [int.from_bytes(lens[8 * i:8 * i + 8], "little") for i in range(self.size)]
        displs = [sum(counts[:i]) for i in range(self.size)]
        recv = bytearray(sum(counts))
        self.wait(self.comm.Igatherv([data, MPI.BYTE], [recv, counts, displs, MPI.BYTE],
                                     root=root), phase, step)
        return [json.loads(recv[d:d + c]) for d, c in zip(displs, counts)]

    def bcast(self, obj: Any, phase: str, step: int | None = None, root: int = 0) -> Any:
        """Broadcast one JSON object from ``root``. All ranks call."""
        data = json.dumps(obj).encode() if self.rank == root else b""
        size = bytearray(len(data).to_bytes(8, "little"))
        self.wait(self.comm.Ibcast([size, MPI.BYTE], root=root), phase, step)
        buf = bytearray(data) if self.rank == root else bytearray(int.from_bytes(size, "little"))
        self.wait(self.comm.Ibcast([buf, MPI.BYTE], root=root), phase, step)
        return json.loads(buf)

    def agree(self, failure: str | None, phase: str, step: int) -> dict[int, str]:
        """Exchange local failures; every rank returns the same ``{rank: failure}``. All call."""
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


def describe(exc: BaseException) -> str:
    """One-line description of an exception for failure reports."""
    return f"{type(exc).__name__}: {exc}"


_hooks_installed = False


def install_abort_hooks() -> None:
    """Make an uncaught exception in any thread abort the MPI world instead of hanging it.

    Equivalent to running under ``python -m mpi4py``; installed by :meth:`Topology.create`.
    Local call, idempotent.
    """
    global _hooks_installed
    if _hooks_installed or MPI.COMM_WORLD.Get_size() == 1:
        return
    _hooks_installed = True
    previous = sys.excepthook

    def _abort(kind: str, exc_type: Any, exc: Any, tb: Any) -> None:
        sys.stderr.write(f"ftkit: uncaught exception in {kind} on rank "
                         f"{MPI.COMM_WORLD.Get_rank()}; aborting the MPI job\n")
        traceback.print_exception(exc_type, exc, tb)
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)

    def excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            previous(exc_type, exc, tb)
            return
        _abort("main thread", exc_type, exc, tb)

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        _abort(f"thread {args.thread.name if args.thread else '?'}",
               args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = excepthook
    threading.excepthook = thread_hook
