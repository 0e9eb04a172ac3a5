"""Who is who after a failure: shrink the world, give the failed ranks' places to spares.

Every process has a fixed identity, its rank in ``MPI_COMM_WORLD`` (its *process*), and a
role: the *logical rank* it trains as (0..N-1), or -1 for a spare. After a failure the
survivors and the spares shrink the revoked world (ULFM ``MPI_Comm_shrink``: every survivor
gets the same new communicator), exchange ``(process, logical rank)``, and every one of them
computes the same assignment with :func:`assign` (pure): working ranks keep their logical
ranks, the spares with the lowest process numbers take the failed ranks' places in order,
the others stay spares. The working communicator is then split off in logical-rank order,
so rank numbers, the DP x TP x PP grid and the (virtual) node of every rank are what they
were before the failure.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
from mpi4py import MPI

from ftkit.errors import FtkitError


class NotEnoughSpares(FtkitError):
    """More working ranks failed than spares are left: the job falls back to a relaunch."""


@dataclasses.dataclass(frozen=True)
class Assignment:
    """The roles of one generation (identical on every process)."""

    roles: dict[int, int]            # process -> logical rank, -1 for a spare left idle
    failed: list[int]                # logical ranks whose process died
    replaced: dict[int, int]         # logical rank -> the spare's process that took it
    spares_left: int


def assign(present: dict[int, int], n: int) -> Assignment:
    """Roles after a failure, from ``present`` (every surviving process -> its logical
    rank or -1) and the number ``n`` of working ranks. Pure; NotEnoughSpares when the
    failed ranks outnumber the surviving spares."""
    held = {lr for lr in present.values() if lr >= 0}
    failed = [lr for lr in range(n) if lr not in held]
    spares = sorted(p for p, lr in present.items() if lr < 0)
    if len(failed) > len(spares):
        raise NotEnoughSpares(
            f"{len(failed)} working rank(s) failed ({', '.join(map(str, failed))}) and "
            f"{len(spares)} spare rank(s) are left")
    replaced = dict(zip(failed, spares))
    roles = dict(present)
    roles.update({p: lr for lr, p in replaced.items()})
    return Assignment(roles=roles, failed=failed, replaced=replaced,
                      spares_left=len(spares) - len(failed))


@dataclasses.dataclass
class Generation:
    """One generation's communicators and this process's role in them."""

    world: MPI.Comm          # every live process (working ranks and spares)
    work: MPI.Comm | None    # the N working ranks in logical order (None on a spare)
    logical: int             # this process's logical rank, -1 on a spare
    n: int


def first_generation(n: int) -> Generation:
    """Generation 0: world ranks below ``n`` work, the rest are spares. All processes call."""
    world = MPI.COMM_WORLD.Dup()
    world.Set_errhandler(MPI.ERRORS_RETURN)
    logical = world.Get_rank() if world.Get_rank() < n else -1
    work = world.Split(0 if logical >= 0 else 1, world.Get_rank())
    return Generation(world=world, work=work if logical >= 0 else None, logical=logical, n=n)


@dataclasses.dataclass(frozen=True)
class Rebuilt:
    generation: Generation
    assignment: Assignment
    timings: dict[str, float]


def rebuild(old: Generation) -> Rebuilt:
    """Shrink the (revoked) world, agree on the roles, split the working communicator.
    Every surviving process calls (working ranks and spares). MPI.Exception when another
    process fails meanwhile (the caller may try again), NotEnoughSpares on every process
    alike."""
    t0 = time.monotonic()
    world = old.world.Shrink()
    world.Set_errhandler(MPI.ERRORS_RETURN)
    t1 = time.monotonic()
    me = np.array([MPI.COMM_WORLD.Get_rank(), old.logical], dtype=np.int64)
    table = np.empty(2 * world.Get_size(), dtype=np.int64)
    world.Allgather([me, MPI.INT64_T], [table, MPI.INT64_T])
    world.Agree(1)                       # nobody failed while the table was gathered
    t2 = time.monotonic()
    present = {int(table[2 * i]): int(table[2 * i + 1]) for i in range(world.Get_size())}
    roles = assign(present, old.n)
    logical = roles.roles[MPI.COMM_WORLD.Get_rank()]
    work = world.Split(0 if logical >= 0 else 1, logical if logical >= 0 else
                       MPI.COMM_WORLD.Get_rank())
    t3 = time.monotonic()
    gen = Generation(world=world, work=work if logical >= 0 else None, logical=logical,
                     n=old.n)
    return Rebuilt(gen, roles, {"shrink_s": t1 - t0, "agree_s": t2 - t1, "split_s": t3 - t2})
