"""ftkit.init_torch_distributed on 4 MPI ranks: torch's default group matches MPI's world."""
from __future__ import annotations

import pytest

from ftkit.torchdist import rendezvous_host

from .mpi_helpers import RANK, SIZE, WORLD

torch = pytest.importorskip("torch")


def test_torch_group_over_the_mpi_world() -> None:
    import torch.distributed as dist

    import ftkit
    assert not dist.is_initialized()
    device = ftkit.init_torch_distributed(WORLD, backend="gloo", timeout_s=60)
    try:
        assert device.type in ("cpu", "cuda")
        assert (dist.get_rank(), dist.get_world_size()) == (RANK, SIZE)
        t = torch.tensor([float(RANK + 1)])
        dist.all_reduce(t)
        assert t.item() == SIZE * (SIZE + 1) / 2
        got = [None] * SIZE
        dist.all_gather_object(got, RANK)
        assert got == list(range(SIZE))
    finally:
        dist.destroy_process_group()


def test_rendezvous_host_prefers_the_launchers_address() -> None:
    assert rendezvous_host({"MASTER_ADDR": " 10.0.0.7 ", "FTKIT_MASTER_ADDR": "x"}) == "10.0.0.7"
    assert rendezvous_host({"FTKIT_MASTER_ADDR": "n001-ib"}) == "n001-ib"
    assert rendezvous_host({"MASTER_ADDR": ""}) != ""
