"""The way out when in-job recovery is impossible: record why and abort the world, so
``ftkit run`` relaunches the job."""
from __future__ import annotations

import logging

from ftkit.errors import FtkitError

log = logging.getLogger("ftkit.injob.resilient")


def fall_back(why: str, rank: int) -> None:
    """In-job recovery is impossible: say why (the attempt line of ``ftkit run`` names it)
    and abort the world, so ``ftkit run`` relaunches the job. ``rank``: this process's
    logical rank (-1: a spare). Never returns."""
    from mpi4py import MPI

    from ftkit.jobdir.fatal import record_death
    process = MPI.COMM_WORLD.Get_rank()
    line = f"in-job recovery impossible: {why}; falling back to a relaunch"
    log.error("%s: %s", who(rank, process), line)
    # the record is keyed like the launcher's report: by the process (MPI_COMM_WORLD rank)
    record_death(process, aborted=line if rank == process else f"({who(rank, process)}) "
                 f"{line}")
    for handler in logging.getLogger("ftkit").handlers:
        handler.flush()
    MPI.COMM_WORLD.Abort(4)
    raise FtkitError(line)          # not reached


def who(rank: int, process: int) -> str:
    """``rank 2``, ``rank 2 (process 4)`` or ``spare process 5`` (pure): a logical rank
    differs from its process after a spare took it over."""
    if rank < 0:
        return f"spare process {process}"
    return f"rank {rank}" if rank == process else f"rank {rank} (process {process})"
