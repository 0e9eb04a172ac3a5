"""Starting ``torch.distributed`` over the ranks of an MPI job, on one host or many.

``ftkit run`` (or ``mpiexec``/``srun``) starts the processes and MPI numbers them; torch needs
a rendezvous address, a rank and a world size. :func:`init_torch_distributed` takes them from
MPI: rank 0 picks a free TCP port on its own host and broadcasts ``host:port``; every rank
joins with its MPI rank. On GPUs it uses NCCL and gives each rank the device of its node-local
index (the ranks of one node share its GPUs round-robin); on CPUs, gloo.

The host is rank 0's name as the other hosts reach it: ``$MASTER_ADDR`` when set (the
convention of torch's own launchers), else ``$FTKIT_MASTER_ADDR``, else rank 0's host
name. Imports torch and mpi4py on call only.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

ADDR_ENV = ("MASTER_ADDR", "FTKIT_MASTER_ADDR")


def rendezvous_host(env: dict[str, str] | None = None) -> str:
    """The address other hosts use to reach this one (see the module docstring; pure but
    for the host name)."""
    env = dict(os.environ) if env is None else env
    for key in ADDR_ENV:
        if env.get(key, "").strip():
            return env[key].strip()
    return socket.gethostname()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def init_torch_distributed(comm: MPI.Comm | Any = None, backend: str | None = None,
                           timeout_s: float = 300.0) -> torch.device:
    """Start torch's default process group over ``comm`` (default ``MPI.COMM_WORLD``, or a
    :class:`~ftkit.Topology`'s ``comm``); returns this rank's device. All ranks of ``comm``
    call (collective).

    ``backend``: ``"nccl"`` when CUDA is available, else ``"gloo"``. With CUDA, the device is
    ``cuda:<node-local rank mod devices>`` and is made current. A process that another
    launcher (``torchrun``) started as one of N but that MPI sees alone gets ConfigError at
    once (:func:`~ftkit.comm.topology.check_launcher`), before any rendezvous could wait.
    """
    from mpi4py import MPI

    from ftkit.comm.topology import check_launcher
    check_launcher(os.environ, MPI.COMM_WORLD.Get_size())   # torchrun: refuse, not hang
    import torch
    import torch.distributed as dist
    comm = getattr(comm, "comm", comm) or MPI.COMM_WORLD
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    device = torch.device("cpu")
    if cuda:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, comm.Get_rank())
        local = node.Get_rank()
        node.Free()
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    where = (rendezvous_host(), _free_port()) if comm.Get_rank() == 0 else None
    host, port = comm.bcast(where, root=0)
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}",
                            rank=comm.Get_rank(), world_size=comm.Get_size(),
                            timeout=timedelta(seconds=timeout_s))
    return device
