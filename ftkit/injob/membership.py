"""Who is who after a failure: shrink the world, give the failed ranks' places to spares.

Every process has a fixed identity, its rank in ``MPI_COMM_WORLD`` (its *process*), the
machine it runs on (its *host*: ``SLURMD_NODENAME`` under Slurm, else the host name), and a
role: the *logical rank* it trains as (0..N-1), or -1 for a spare. After a failure the
survivors and the spares shrink the revoked world (ULFM ``MPI_Comm_shrink``: every survivor
gets the same new communicator), exchange ``(process, logical rank)``, and every one of them
computes the same assignment with :func:`assign` (pure). The working communicator is then
split off in logical-rank order, so rank numbers, the DP x TP x PP grid and the node of
every rank are what they were before the failure.

A node's ranks always run on one host (their node-local directory lives there): a failed
rank is taken by a spare on its node's host when that host has enough of them (virtual
nodes on one machine: always), else the whole node moves to a host with a spare for each of
its ranks (Slurm: a spare node) and its surviving processes become spares; its ranks'
shards are then rebuilt from the redundancy levels, as after a node's loss.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Mapping, Sequence

import numpy as np
from mpi4py import MPI

from ftkit.errors import FtkitError

#: bytes of a host name in the table gathered at the first generation
HOST_BYTES = 256


class NotEnoughSpares(FtkitError):
    """More working ranks failed than spares are left: the job falls back to a relaunch."""


@dataclasses.dataclass(frozen=True)
class Assignment:
    """The roles of one generation (identical on every process)."""

    roles: dict[int, int]            # process -> logical rank, -1 for a spare left idle
    failed: list[int]                # logical ranks whose process died
    replaced: dict[int, int]         # logical rank -> the spare's process that took it
    spares_left: int
    moved: list[int] = dataclasses.field(default_factory=list)  # live ranks that moved host


def assign(present: dict[int, int], n: int, hosts: Mapping[int, str] | None = None,
           node_of: Sequence[int] | None = None, was: Mapping[int, int] | None = None
           ) -> Assignment:
    """Roles after a failure, from ``present`` (every surviving process -> its logical
    rank or -1) and the number ``n`` of working ranks; ``hosts`` (process -> host, every
    process of the job), ``node_of`` (logical rank -> node) and ``was`` (logical rank ->
    its process before the failure) place a node's ranks on one host (module doc); without
    them every process counts as one host and every rank as its own node. Pure;
    NotEnoughSpares when the failed ranks cannot all be placed."""
    hosts = hosts if hosts is not None else {}
    node_of = list(node_of) if node_of is not None else list(range(n))
    held = {lr: p for p, lr in present.items() if lr >= 0}
    failed = [lr for lr in range(n) if lr not in held]
    free = sorted(p for p, lr in present.items() if lr < 0)
    short = f"{len(failed)} working rank(s) failed ({', '.join(map(str, failed))}) and " \
        f"{len(free)} spare rank(s) are left"
    if len(failed) > len(free):
        raise NotEnoughSpares(short)
    roles: dict[int, int] = dict(present)
    replaced: dict[int, int] = {}
    moved: list[int] = []
    retired: list[int] = []                     # processes of moved ranks: spares now
    for node in sorted({node_of[lr] for lr in failed}):
        members = [lr for lr in range(n) if node_of[lr] == node]
        lost = [lr for lr in members if lr not in held]
        home = [hosts.get(held[lr], "") for lr in members if lr in held] or \
            [hosts.get((was or {}).get(lr, -1), "") for lr in lost]
        takers = [p for p in free if hosts.get(p, "") == home[0]][:len(lost)]
        if len(takers) < len(lost):
            takers, lost = _new_host(free, hosts, len(members)), members
            if not takers:
                raise NotEnoughSpares(f"{short}, not {len(members)} on one host for node "
                                      f"{node}")
        for lr, p in zip(lost, takers):
            if lr in held:                          # a live rank of a node that moves
                roles[held[lr]] = -1
                retired.append(held[lr])
                moved.append(lr)
            roles[p] = lr
            replaced[lr] = p
            free.remove(p)
    return Assignment(roles=roles, failed=failed, replaced=replaced,
                      spares_left=len(free) + len(retired), moved=moved)


def _new_host(free: list[int], hosts: Mapping[int, str], count: int) -> list[int]:
    """``count`` spares of the first host (by lowest process) that has that many; []."""
    for host in dict.fromkeys(hosts.get(p, "") for p in free):
        on = [p for p in free if hosts.get(p, "") == host]
        if len(on) >= count:
            return on[:count]
    return []


def host_name() -> str:
    """This process's host: the Slurm node it runs on, else the machine's name. Local."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


@dataclasses.dataclass
class Generation:
    """One generation's communicators and this process's role in them."""

    world: MPI.Comm          # every live process (working ranks and spares)
    work: MPI.Comm | None    # the N working ranks in logical order (None on a spare)
    logical: int             # this process's logical rank, -1 on a spare
    n: int
    hosts: dict[int, str] = dataclasses.field(default_factory=dict)  # process -> host
    node_of: list[int] = dataclasses.field(default_factory=list)     # logical rank -> node
    holders: dict[int, int] = dataclasses.field(default_factory=dict)  # logical -> process


def first_generation(n: int) -> Generation:
    """Generation 0: world ranks below ``n`` work, the rest are spares; every process's
    host is gathered. All processes call."""
    from ftkit.comm.topology import number_groups, ranks_per_node_setting, virtual_nodes
    world = MPI.COMM_WORLD.Dup()
    world.Set_errhandler(MPI.ERRORS_RETURN)
    logical = world.Get_rank() if world.Get_rank() < n else -1
    work = world.Split(0 if logical >= 0 else 1, world.Get_rank())
    mine = bytearray(host_name().encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0"))
    table = bytearray(HOST_BYTES * world.Get_size())
    world.Allgather([mine, MPI.BYTE], [table, MPI.BYTE])
    hosts = {p: bytes(table[p * HOST_BYTES:(p + 1) * HOST_BYTES]).rstrip(b"\0").decode(
        errors="replace") for p in range(world.Get_size())}
    per_node = ranks_per_node_setting(None)
    node_of = virtual_nodes(n, per_node) if per_node else \
        number_groups([hosts[lr] for lr in range(n)])
    return Generation(world=world, work=work if logical >= 0 else None, logical=logical, n=n,
                      hosts=hosts, node_of=node_of, holders={lr: lr for lr in range(n)})


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
    roles = assign(present, old.n, old.hosts, old.node_of, old.holders)
    logical = roles.roles[MPI.COMM_WORLD.Get_rank()]
    work = world.Split(0 if logical >= 0 else 1, logical if logical >= 0 else
                       MPI.COMM_WORLD.Get_rank())
    t3 = time.monotonic()
    gen = Generation(world=world, work=work if logical >= 0 else None, logical=logical,
                     n=old.n, hosts=old.hosts, node_of=old.node_of,
                     holders={lr: p for p, lr in roles.roles.items() if lr >= 0})
    return Rebuilt(gen, roles, {"shrink_s": t1 - t0, "agree_s": t2 - t1, "split_s": t3 - t2})
