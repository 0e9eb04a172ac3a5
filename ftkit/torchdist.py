"""Starting ``torch.distributed`` over the ranks of an MPI job, on one host or many.

``ftkit run`` (or ``mpiexec``/``srun``) starts the processes and MPI numbers them; torch needs
a rendezvous address, a rank and a world size. :func:`init_torch_distributed` takes them from
MPI: rank 0 picks a free TCP port on its own host and broadcasts ``host:port``; every rank
joins with its MPI rank. On GPUs it uses NCCL and gives each rank the device of its node-local
index (the ranks of one node share its GPUs round-robin); on CPUs, gloo.

The host is rank 0's name as the other hosts reach it: ``$MASTER_ADDR`` when set (the
convention of torch's own launchers), else ``$FTKIT_MASTER_ADDR``, else rank 0's host
name. Imports torch and mpi4py on call only.

The rendezvous store (a ``TCPStore`` on rank 0) is made without waiting for the other ranks
to join it, and its client socket is recorded for :mod:`ftkit.injob.sockets` at once: every
later wait of the rendezvous (the gloo group's exchange of addresses) is a read on that
socket, so when a peer dies meanwhile under in-job recovery, shutting it down ends the wait
within milliseconds instead of the store's timeout. Making the store (a client connecting
to rank 0's server, which retries until the timeout when rank 0 is dead) runs on a helper
thread under in-job recovery, so that the caller's wait ends when the failure is known.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI

ADDR_ENV = ("MASTER_ADDR", "FTKIT_MASTER_ADDR")
T = TypeVar("T")


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

    from ftkit.comm.dist import keep_children_out_of_mpi
    from ftkit.comm.topology import check_launcher
    from ftkit.injob import sockets
    check_launcher(os.environ, MPI.COMM_WORLD.Get_size())   # torchrun: refuse, not hang
    keep_children_out_of_mpi()           # spawn / forkserver loader workers
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
    timeout = timedelta(seconds=timeout_s)
    store = _interruptible(lambda: sockets.recording(lambda: dist.TCPStore(
        host, port, world_size=comm.Get_size(), is_master=comm.Get_rank() == 0,
        timeout=timeout, wait_for_workers=False)), timeout_s, "the rendezvous store")
    dist.init_process_group(backend, store=store, rank=comm.Get_rank(),
                            world_size=comm.Get_size(), timeout=timeout)
    return device


def _interruptible(make: Callable[[], T], timeout_s: float, what: str) -> T:
    """``make()``; under in-job recovery on a daemon thread, so that this one raises
    PeerLost as soon as a peer's failure is known (a client connecting to the store of a
    dead rank 0 retries until its timeout; the thread is left to that and its result
    dropped). Local."""
    from ftkit.comm import flag
    if not flag.active():
        return make()
    future: cf.Future[T] = cf.Future()

    def run() -> None:
        try:
            future.set_result(make())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            future.set_exception(exc)
    threading.Thread(target=run, name=f"ftkit {what}", daemon=True).start()
    flag.wait_done(future, timeout_s, what, flag.generation())
    return future.result()
