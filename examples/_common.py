"""Helpers shared by the example training scripts (not part of the ftkit package)."""
from __future__ import annotations

import json
from typing import Any

from mpi4py import MPI

import ftkit


def init_torch_distributed(comm: MPI.Comm, timeout_s: float = 300.0) -> None:
    """Start a gloo process group over the MPI ranks (ftkit's helper; gloo even with CUDA:
    the examples build their own NCCL subgroups on top)."""
    ftkit.init_torch_distributed(comm, backend="gloo", timeout_s=timeout_s)


def emit(comm: MPI.Comm, **record: Any) -> None:
    """Print one JSON line on rank 0."""
    if comm.rank == 0:
        print(json.dumps(record), flush=True)
