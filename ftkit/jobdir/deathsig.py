"""Parent-death signals (Linux ``PR_SET_PDEATHSIG``): a process that must not outlive the one
that started it asks the kernel for a signal when that parent dies.

Three users: ``ftkit run`` starts the launcher with one (the launcher ends its ranks when
``ftkit run`` is killed, :mod:`ftkit.launch.orphans`); every rank arms one at
``Topology.create`` (:func:`bind_to_launcher`: a launcher that dies without ending its ranks,
as ``mpiexec`` may when it is killed mid-job, leaves no rank behind holding the job's locks);
a rank's multiprocessing forkserver arms one (:mod:`ftkit.launch.childguard`).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` (looked up before any fork), or None off Linux."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name, use_errno=True).prctl if name else None
    except (OSError, AttributeError):
        return None
    return fn  # type: ignore[no-any-return]


def die_with(parent: int, signum: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for the launcher: the kernel sends it ``signum`` when process
    ``parent`` (``ftkit run``, which must call this from the thread that starts the launcher
    and lives as long as it) dies; a parent already gone before the call ends it at once.
    None where the platform has no parent-death signal."""
    prctl = _prctl()
    if prctl is None:
        return None

    def arm() -> None:                   # runs in the child, between fork and exec
        prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        if os.getppid() != parent:       # died before the signal was armed
            os.kill(os.getpid(), signum)
    return arm


def bind_to_launcher() -> None:
    """This rank is SIGKILLed by the kernel when the process that started it (``mpiexec``'s
    daemon, ``slurmstepd``) dies: without its launcher a rank can neither finish nor be
    ended, and would hold the job's node-local locks. Local; call once MPI is up."""
    arm = die_with(os.getppid(), signal.SIGKILL)
    if arm is not None:
        arm()
