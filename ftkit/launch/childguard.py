"""Preloaded by a rank's ``multiprocessing`` forkserver: the forkserver dies with its rank.

Data loader workers started by a forkserver (``multiprocessing_context="forkserver"``, Python
3.14's default on Linux) are the forkserver's children, not the rank's, and each holds the
forkserver's "alive" pipe. A rank that is SIGKILLed leaves them all behind for good: the
forkserver never reads EOF on that pipe, and torch's worker watchdog, which watches the
worker's parent, sees the forkserver alive. They hold the launcher's output pipes, so
``mpiexec`` never ends and the attempt hangs. Imported by the forkserver at its start
(:func:`ftkit.comm.dist.keep_children_out_of_mpi` puts it first on the preload list), this
module arms a parent-death signal: the kernel kills the forkserver with its rank (strictly:
with the rank's thread that started it, the one that first iterated such a loader), its
workers see their parent gone and end.
"""
from __future__ import annotations

import os
import signal

from ftkit.jobdir.deathsig import die_with

_arm = die_with(os.getppid(), signal.SIGKILL)
if _arm is not None:
    _arm()
