"""Process topology: DP/TP/PP groups, nodes, partner map.

Rank order follows Megatron: tp fastest, then dp, then pp::

    rank = pp_idx * (dp * tp) + dp_idx * tp + tp_idx

Nodes come from ``MPI.COMM_TYPE_SHARED`` or, for tests on one machine, from
``FTKIT_RANKS_PER_NODE=K`` (consecutive blocks of K ranks form a *virtual node*).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Hashable, Mapping, Sequence

from mpi4py import MPI

from ftkit.comm import placement
from ftkit.comm.dist import install_abort_hooks, keep_children_out_of_mpi
from ftkit.errors import ConfigError
from ftkit.jobdir.deathsig import bind_to_launcher
from ftkit.jobdir.fatal import recorded


@dataclasses.dataclass(frozen=True)
class Coords:
    """Position of one rank in the DP x TP x PP grid."""

    dp: int
    tp: int
    pp: int


def coords_of(rank: int, dp: int, tp: int, pp: int) -> Coords:
    """Grid coordinates of ``rank`` (pure)."""
    return Coords(dp=(rank // tp) % dp, tp=rank % tp, pp=rank // (tp * dp))


def check_shape(world: int, tp: int, pp: int) -> int:
    """Return dp for a world of ``world`` ranks split into tp x pp, or raise ConfigError."""
    if tp < 1 or pp < 1:
        raise ConfigError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
    if world % (tp * pp):
        raise ConfigError(f"world size {world} is not divisible by tp*pp = {tp}*{pp} = "
                          f"{tp * pp}")
    return world // (tp * pp)


def virtual_nodes(world: int, ranks_per_node: int) -> list[int]:
    """Node id of every rank when consecutive blocks of ``ranks_per_node`` form a node."""
    if ranks_per_node < 1:
        raise ConfigError(f"FTKIT_RANKS_PER_NODE must be >= 1, got {ranks_per_node}")
    return [r // ranks_per_node for r in range(world)]


#: (size variable, rank variable, who sets them) of launchers that start several processes
LAUNCHER_VARS = (("WORLD_SIZE", "RANK", "torchrun"), ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "srun"),
                 ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "Open MPI's mpiexec"),
                 ("PMI_SIZE", "PMI_RANK", "a PMI launcher (mpiexec, srun)"))


def check_launcher(env: Mapping[str, str], mpi_world: int) -> None:
    """Refuse a process that its launcher started as one of N but that MPI sees alone
    (``torchrun``, or ``srun``/``mpiexec`` with an MPI that mpi4py is not built against):
    every such process would be rank 0 of its own world and write the same files. Pure;
    raises ConfigError. A world of more than one process is MPI's word and is trusted."""
    if mpi_world != 1:
        return
    for size_key, rank_key, who in LAUNCHER_VARS:
        raw = env.get(size_key, "").strip()
        if raw.isdigit() and int(raw) > 1:
            raise ConfigError(
                f"this process is one of {raw} started by {who} ({size_key}={raw}, "
                f"{rank_key}={env.get(rank_key, '?')}), but MPI sees a world of 1 process: "
                f"every process would be rank 0 and write the same files. ftkit's ranks are "
                f"MPI ranks: launch with `ftkit run -n {raw} -- python ...` (or mpiexec/srun "
                f"of the MPI that mpi4py is built against)")


class Topology:
    """Communicators and placement of one job. Build it with :meth:`create` (collective)."""

    def __init__(self, comm: MPI.Comm, *, dp: int, tp: int, pp: int, rank_node: list[int],
                 node_comm: MPI.Comm, dp_group: MPI.Comm, tp_group: MPI.Comm,
                 pp_group: MPI.Comm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.world = comm.Get_size()
        self.dp, self.tp, self.pp = dp, tp, pp
        self.coords = coords_of(self.rank, dp, tp, pp)
        self.rank_node = rank_node
        self.node = rank_node[self.rank]
        self.node_comm = node_comm
        self.node_rank = node_comm.Get_rank()
        self.dp_group, self.tp_group, self.pp_group = dp_group, tp_group, pp_group

    @classmethod
    def create(cls, comm: MPI.Comm, tp: int = 1, pp: int = 1,
               ranks_per_node: int | None = None) -> Topology:
        """Split ``comm`` into DP/TP/PP groups and detect nodes. All ranks of ``comm`` call.

        ``ranks_per_node`` defaults to ``$FTKIT_RANKS_PER_NODE`` (virtual nodes) and, when
        unset, to the real nodes found with ``COMM_TYPE_SHARED``. A :class:`ConfigError`
        (a shape that does not fit the world) is raised on every rank and recorded for
        ``ftkit run`` (:mod:`ftkit.jobdir.fatal`): a relaunch would fail the same way.
        """
        install_abort_hooks()
        keep_children_out_of_mpi()
        bind_to_launcher()
        world, rank = comm.Get_size(), comm.Get_rank()
        with recorded(rank, ConfigError):
            check_launcher(os.environ, MPI.COMM_WORLD.Get_size())
            dp, ranks_per_node = check_shape(world, tp, pp), ranks_per_node_setting(ranks_per_node)
        if ranks_per_node:
            rank_node = virtual_nodes(world, ranks_per_node)
        else:
            rank_node = _real_nodes(comm)
        node_comm = comm.Split(rank_node[rank], rank)
        c = coords_of(rank, dp, tp, pp)
        tp_group = comm.Split(c.pp * dp + c.dp, rank)
        dp_group = comm.Split(c.pp * tp + c.tp, rank)
        pp_group = comm.Split(c.dp * tp + c.tp, rank)
        return cls(comm, dp=dp, tp=tp, pp=pp, rank_node=rank_node, node_comm=node_comm,
                   dp_group=dp_group, tp_group=tp_group, pp_group=pp_group)

    # ------------------------------------------------------------------ queries
    @property
    def nodes(self) -> list[int]:
        return sorted(set(self.rank_node))

    @property
    def is_node_leader(self) -> bool:
        return self.node_rank == 0

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.rank_node) if n == node]

    @property
    def shard_of(self) -> list[tuple[int, int]]:
        """(tp, pp) coordinates of every rank: ranks with equal values are DP replicas."""
        return [(c.tp, c.pp) for c in (coords_of(r, self.dp, self.tp, self.pp)
                                       for r in range(self.world))]

    def partner_map(self) -> list[int]:
        """``partners[r]`` stores rank r's copy; always on another node (ConfigError if none)."""
        return placement.partner_map(self.rank_node, self.shard_of)

    def erasure_sets(self, size: int, *, minimum: int = 2, what: str = "erasure"
                     ) -> list[list[int]]:
        """Erasure sets of ``size`` ranks on distinct nodes (ConfigError if impossible)."""
        return placement.erasure_sets(self.rank_node, size, minimum=minimum,
                                      shard_of=self.shard_of, what=what)

    def dp_ring(self) -> list[int] | None:
        """This rank's data-parallel replicas in the ring order of a shared snapshot
        (neighbours on different nodes, :func:`placement.dp_rings`); None when dp is 1 or
        the replicas cannot be so placed (then every rank keeps its whole shard). Local."""
        rings = placement.dp_rings(self.rank_node, self.shard_of)
        return None if rings is None else next(r for r in rings if self.rank in r)

    def describe(self) -> dict[str, int]:
        """JSON-able description stored in shard headers."""
        return {"world": self.world, "dp": self.dp, "tp": self.tp, "pp": self.pp,
                "dp_idx": self.coords.dp, "tp_idx": self.coords.tp, "pp_idx": self.coords.pp,
                "node": self.node, "nodes": len(self.nodes)}

    def free(self) -> None:
        """Free the sub-communicators (local)."""
        for c in (self.node_comm, self.dp_group, self.tp_group, self.pp_group):
            try:
                c.Free()
            except MPI.Exception:
                pass


def ranks_per_node_setting(given: int | None) -> int:
    """``given``, else ``$FTKIT_RANKS_PER_NODE``; 0 means real nodes. ConfigError if invalid."""
    if given is None:
        env = os.environ.get("FTKIT_RANKS_PER_NODE", "")
        try:
            given = int(env) if env else 0
        except ValueError:
            raise ConfigError(f"FTKIT_RANKS_PER_NODE: expected an integer, got {env!r}") from None
    if given < 0:
        raise ConfigError(f"FTKIT_RANKS_PER_NODE must be >= 1, got {given}")
    return given


def _real_nodes(comm: MPI.Comm) -> list[int]:
    """Node id of every rank from COMM_TYPE_SHARED; nodes numbered by their lowest rank."""
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    leader = shared.allreduce(comm.Get_rank(), op=MPI.MIN)
    shared.Free()
    return number_groups(comm.allgather(leader))


def number_groups(keys: Sequence[Hashable]) -> list[int]:
    """Node of every rank from its group's key (a node leader's rank, a host name): nodes
    numbered in the order of their lowest rank. Pure."""
    index: dict[Hashable, int] = {}
    return [index.setdefault(k, len(index)) for k in keys]
