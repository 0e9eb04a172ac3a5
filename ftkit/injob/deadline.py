"""The recovery deadline: ``FTKIT_TIMEOUT`` from the moment a process learns of a failure to
the moment its next generation starts.

A process that hangs somewhere after a peer's death — still in ``train`` (blocked where no
wait of ftkit polls the failure flag), in the teardown of its Checkpointers, or in the
shrink — is alive to MPI, so every other process's shrink waits for it, and the heartbeat
ring of the failed generation is gone. The deadline bounds all of it: it is armed when the
flag is first tripped here (:meth:`Deadline.arm`, by the watcher or the main thread) and
cancelled when the recovery is done. When it expires, the process writes every thread's
stack to stderr (where it was stuck is the first thing a developer asks) and falls back
(:func:`ftkit.injob.fallback.fall_back`): it aborts the world, and ``ftkit run``
relaunches the job, the attempt line naming the phase the process was in.

Local to the process; no communication.
"""
from __future__ import annotations

import faulthandler
import logging
import sys
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Deadline:
    """One generation's recovery deadline of this process (module doc). ``give_up(why,
    rank)`` is called from the timer thread when it expires (``fall_back``: never
    returns)."""

    def __init__(self, seconds: float, rank: int,
                 give_up: Callable[[str, int], None], name: str = "") -> None:
        self.seconds, self.rank, self._give_up = seconds, rank, give_up
        self.name = name or f"rank {rank}"     # who this process is, for the stack dump
        self.phase = "training"         # where the main thread is: said when it expires
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._done = False

    def arm(self) -> None:
        """Start the clock (the first call only; later calls and calls after
        :meth:`cancel` do nothing). Any thread."""
        with self._lock:
            if self._timer is not None or self._done:
                return
            self._timer = threading.Timer(self.seconds, self._expire)
            self._timer.name = "ftkit-recovery-deadline"
            self._timer.daemon = True
            self._timer.start()

    def enter(self, phase: str) -> None:
        """The main thread moved on to ``phase`` (teardown, shrink)."""
        self.phase = phase

    def cancel(self) -> None:
        """The recovery finished in time (or the job did): the clock stops for good."""
        with self._lock:
            self._done = True
            if self._timer is not None:
                self._timer.cancel()

    @property
    def armed(self) -> bool:
        return self._timer is not None and not self._done

    def _expire(self) -> None:
        with self._lock:
            if self._done:
                return
        why = (f"the recovery did not finish within {self.seconds:g} s of the failure "
               f"(FTKIT_TIMEOUT): this process was still in its {self.phase}")
        _dump_stacks(f"ftkit: in-job: {self.name}: {why}; the stacks of its threads:")
        self._give_up(why, self.rank)


def _dump_stacks(title: str) -> None:
    """Every thread's Python stack on stderr, under ``title``. Never raises."""
    try:
        print(title, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError) as exc:   # stderr closed or replaced
        log.warning("in-job: cannot write the stacks: %s", exc)
