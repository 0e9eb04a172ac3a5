"""Helpers shared by the example training scripts (not part of the ftkit package)."""
from __future__ import annotations

import json
import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from mpi4py import MPI


def init_torch_distributed(comm: MPI.Comm, timeout_s: float = 300.0) -> None:
    """Start a gloo process group over the MPI ranks (port chosen by rank 0, broadcast)."""
    port = 0
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size,
                            timeout=timedelta(seconds=timeout_s))


def emit(comm: MPI.Comm, **record: Any) -> None:
    """Print one JSON line on rank 0."""
    if comm.rank == 0:
        print(json.dumps(record), flush=True)
