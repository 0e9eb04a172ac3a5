"""Heartbeats along a ring: a process that hangs is ended, so that ULFM recovers from it.

ULFM learns of a process's *death*. A process that stops without dying (SIGSTOP, a frozen
machine, an interpreter wedged in a call that holds the GIL) stays a member of every
communicator: its peers wait for it in their collectives until ``FTKIT_TIMEOUT`` aborts the
job, and a shrink would wait for it too. So every process's watcher thread
(:mod:`ftkit.injob.watch`) also keeps a :class:`Ring`: it sends one byte to its successor in
the generation's world every ``deadline / 4`` seconds and expects one from its predecessor.
A predecessor silent for ``deadline`` seconds (``FTKIT_HEARTBEAT``) is *hung*; its successor
ends it (:func:`end`): SIGKILL when both run in one operating system (same host name and
process-id namespace; their pids and hosts are exchanged when the ring is built), which turns
the hang into a death that ULFM reports to everyone as usual; from another machine it
cannot, and the job falls back to a relaunch with a line that names the process.

What the ring sees is the *process*: a rank whose watcher thread still runs while its training
thread loops forever, or waits in a collective on another rank, still beats; ``FTKIT_TIMEOUT``
bounds those waits as before (abort, relaunch).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket

from mpi4py import MPI

#: tag of the heartbeat messages on the world communicator (the watch's DONE uses 7)
TAG = 8
#: heartbeats sent per deadline
BEATS = 4
#: bytes of the identity message exchanged when a ring is built
_IDENTITY_BYTES = 512


@dataclasses.dataclass(frozen=True)
class Peer:
    """A process of the ring: its rank in the generation's world, its logical rank (-1 for
    a spare), pid, and where the pid means something (:func:`system_id`)."""

    process: int
    logical: int
    pid: int
    system: str

    def describe(self) -> str:
        who = f"rank {self.logical}" if self.logical >= 0 else "a spare"
        return f"{who} (process {self.process}, pid {self.pid} on {self.system.split('/')[0]})"


def system_id() -> str:
    """Host name and process-id namespace: two processes with equal ids can signal each
    other by pid. Local, pure read."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{socket.gethostname()}/{ns}"


def _encode(peer: Peer) -> bytearray:
    raw = json.dumps(dataclasses.asdict(peer)).encode()[:_IDENTITY_BYTES]
    return bytearray(raw.ljust(_IDENTITY_BYTES, b" "))


def _decode(raw: bytearray) -> Peer:
    fields = json.loads(bytes(raw).decode())
    return Peer(process=int(fields["process"]), logical=int(fields["logical"]),
                pid=int(fields["pid"]), system=str(fields["system"]))


class Ring:
    """This process's place in the heartbeat ring of one generation's ``world``. Every
    process of ``world`` builds one at the same point (a send-receive with its neighbours:
    MPI.Exception when one failed); then only its watcher thread calls :meth:`poll`."""

    def __init__(self, world: MPI.Comm, logical: int, deadline: float, now: float) -> None:
        size, me = world.Get_size(), world.Get_rank()
        self.world, self.deadline = world, deadline
        self.period = deadline / BEATS
        self.succ, self.pred = (me + 1) % size, (me - 1) % size
        self.me = Peer(process=me, logical=logical, pid=os.getpid(), system=system_id())
        got = bytearray(_IDENTITY_BYTES)
        world.Sendrecv([_encode(self.me), MPI.BYTE], dest=self.succ, sendtag=TAG,
                       recvbuf=[got, MPI.BYTE], source=self.pred, recvtag=TAG)
        self.peer = _decode(got)
        self.heard, self.sent = now, float("-inf")
        self._buf = bytearray(1)
        self._req = world.Irecv([self._buf, MPI.BYTE], source=self.pred, tag=TAG)
        self._sends: list[MPI.Request] = []

    def poll(self, now: float) -> float | None:
        """Take the predecessor's beats, send ours when due; returns for how long the
        predecessor has been silent once that exceeds the deadline, else None. Watcher
        thread only; MPI.Exception when a neighbour failed."""
        self.take(now)
        self.beat(now)
        return self.overdue(now)

    def take(self, now: float) -> None:
        """Receive the predecessor's beats that arrived (the last one heard ``now``)."""
        while self._req.Test():
            self.heard = now
            self._req = self.world.Irecv([self._buf, MPI.BYTE], source=self.pred, tag=TAG)

    def beat(self, now: float) -> None:
        """Send a beat to the successor when one is due (every :attr:`period`)."""
        if now - self.sent >= self.period:
            self._sends = [r for r in self._sends if not r.Test()]
            self._sends.append(self.world.Isend([b"H", MPI.BYTE], dest=self.succ, tag=TAG))
            self.sent = now

    def overdue(self, now: float) -> float | None:
        """Seconds the predecessor has been silent, when more than the deadline."""
        silent = now - self.heard
        return silent if silent > self.deadline else None

    def close(self) -> None:
        """Withdraw the pending receive (the job ended). Watcher thread; never raises."""
        try:
            self._req.Cancel()
            self._req.Wait()
        except MPI.Exception:
            pass


def end(peer: Peer, me: Peer) -> bool:
    """SIGKILL ``peer`` when it runs in this process's operating system; False when it
    cannot be reached from here (another machine) or is gone already. Local."""
    if peer.system != me.system:
        return False
    try:
        os.kill(peer.pid, signal.SIGKILL)
    except ProcessLookupError:
        return True                  # ended meanwhile: ULFM reports it
    except OSError:
        return False
    return True
