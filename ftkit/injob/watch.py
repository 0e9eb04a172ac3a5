"""The failure watcher: a thread per process that learns of a peer's death from ULFM.

Each generation's *world* communicator (working ranks and spares) carries one receive from
``MPI_ANY_SOURCE`` per process, posted by :class:`Watch`. ULFM completes it with
``MPI_ERR_PROC_FAILED(_PENDING)`` when any process of the world dies, or with
``MPI_ERR_REVOKED`` when a survivor revoked the world; either way the watcher trips the
process's failure flag (:mod:`ftkit.comm.flag`) and revokes the world and the working
communicator, so every survivor and every spare learns of the failure within milliseconds
whatever it is blocked in. A message with :data:`DONE` ends the watch of a job that finished.

The receive is polled with ``MPI_Test`` every :data:`POLL_S` seconds: a blocking wait would
spin a core per process (Open MPI's progress loop). The same loop keeps the heartbeat ring
(:mod:`ftkit.injob.heartbeat`) that ends a process which hangs instead of dying.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable

from mpi4py import MPI

from ftkit.comm import flag
from ftkit.injob import heartbeat, sockets
from ftkit.injob.fallback import fall_back

log = logging.getLogger(__name__)

#: tag of the watch messages on the world communicator (below DistComm's bulk tags)
TAG = 7
DONE = b"D"
POLL_S = 0.002
#: ULFM error classes that mean "a process of this communicator failed"
FAILURE_CLASSES = tuple(getattr(MPI, name) for name in
                        ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                        if hasattr(MPI, name))


def is_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is MPI's report of a failed process or a revoked communicator."""
    return isinstance(exc, MPI.Exception) and exc.Get_error_class() in FAILURE_CLASSES


def revoke(comm: MPI.Comm | None) -> None:
    """Revoke ``comm`` (ULFM), ignoring a communicator that is already revoked or null."""
    if comm is None or comm == MPI.COMM_NULL:
        return
    with contextlib.suppress(MPI.Exception, NotImplementedError, AttributeError):
        comm.Revoke()


class Watch:
    """Watch ``world`` for failures until :meth:`finish` or a failure. Every process of
    ``world`` starts one per generation at the same point (it builds the heartbeat ring
    with its neighbours when ``heartbeat`` > 0: the deadline in seconds; the DONE message
    comes from rank 0)."""

    def __init__(self, world: MPI.Comm, work: MPI.Comm | None, logical: int = -1,
                 heartbeat_s: float = 0.0,
                 on_alarm: Callable[[], None] | None = None) -> None:
        self.world, self.work = world, work
        self._on_alarm = on_alarm               # the recovery deadline's clock starts
        self.done = threading.Event()          # ended by DONE (the job finished)
        self._buf = bytearray(1)
        self._req = world.Irecv([self._buf, MPI.BYTE], source=MPI.ANY_SOURCE, tag=TAG)
        self.ring: heartbeat.Ring | None = None
        if heartbeat_s > 0 and world.Get_size() > 1:
            try:
                self.ring = heartbeat.Ring(world, logical, heartbeat_s, time.monotonic())
            except MPI.Exception as exc:     # a neighbour failed already
                flag.trip(f"MPI reports a failed process while the heartbeat ring was "
                          f"built (error class {exc.Get_error_class()})")
        self._thread = threading.Thread(target=self._run, name="ftkit-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not flag.tripped():
                if self._req.Test():         # only DONE is ever sent on TAG
                    self.done.set()
                    if self.ring is not None:
                        self.ring.close()
                    return
                if self.ring is not None:
                    silent = self.ring.poll(time.monotonic())
                    if silent is not None:
                        self._hung(self.ring, silent)
                flag.wait(POLL_S)
        except MPI.Exception as exc:
            why = ("the world was revoked by a peer" if exc.Get_error_class() ==
                   getattr(MPI, "ERR_REVOKED", -1) else f"MPI reports a failed process "
                   f"(error class {exc.Get_error_class()})")
            flag.trip(why)
        self.alarm(flag.reason())

    def _hung(self, ring: heartbeat.Ring, silent: float) -> None:
        """The predecessor sent no heartbeat within the deadline: end it (ULFM then reports
        its death) and trip the flag; when it runs on another machine, fall back to a
        relaunch. Watcher thread."""
        why = (f"{ring.peer.describe()} sent no heartbeat for {silent:.1f} s "
               f"(FTKIT_HEARTBEAT={ring.deadline:g})")
        ended = heartbeat.end(ring.peer, ring.me)
        _hung_event(ring, silent, ended)
        if not ended:
            fall_back(f"{why}, and it runs on another machine: it cannot be ended from "
                      f"here", ring.me.logical)
        flag.trip(f"{why}: ended (SIGKILL)")

    def alarm(self, why: str) -> None:
        """Trip the flag (if not yet), revoke the world and working communicators and shut
        torch's connections down, so every process learns of the failure and none stays
        blocked in a collective. Local; any thread."""
        if flag.trip(why):
            log.warning("in-job: %s", why)
        if self._on_alarm is not None:
            self._on_alarm()
        revoke(self.world)
        revoke(self.work)
        sockets.shut_down()

    def finish(self) -> None:
        """The job ended well: rank 0 of ``world`` sends DONE to every process, each waits
        for its own watcher to stop. All processes of ``world`` call."""
        if self.world.Get_rank() == 0:
            reqs = [self.world.Isend([DONE, MPI.BYTE], dest=r, tag=TAG)
                    for r in range(self.world.Get_size())]
            MPI.Request.Waitall(reqs)
        self._thread.join()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


def _hung_event(ring: heartbeat.Ring, silent: float, ended: bool) -> None:
    """Record a hung process (``hung`` event) and say so on stderr. Never raises."""
    from ftkit.config import Config
    from ftkit.errors import FtkitError
    from ftkit.jobdir.events import append_event
    peer = ring.peer
    try:
        cfg = Config.load()
        append_event(cfg.events_path, "hung", job=cfg.job, attempt=cfg.attempt,
                     rank=peer.logical, process=peer.process, pid=peer.pid,
                     silent_s=round(silent, 3), deadline_s=ring.deadline, ended=ended,
                     by=ring.me.logical, by_process=ring.me.process)
    except (OSError, FtkitError) as exc:
        log.warning("in-job: cannot record the hung process: %s", exc)
    print(f"ftkit: in-job: {peer.describe()} sent no heartbeat for {silent:.1f} s: "
          f"{'ended (SIGKILL)' if ended else 'on another machine, cannot end it'}",
          file=sys.stderr, flush=True)
