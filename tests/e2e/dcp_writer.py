"""Writes a torch DCP checkpoint the way a torch user does, on 2 MPI ranks over gloo:
``python -m mpi4py dcp_writer.py MODEL_PT OUT_DIR`` loads a ``{name: tensor}`` file (an
``ftkit export --only model``), distributes each tensor as a DTensor over the 2 ranks (rows
cut in 2 where they divide, else replicated) and ``dcp.save``s ``{"model": ...}`` with the
process group: a sharded checkpoint of 2 ranks that ftkit did not write."""
from __future__ import annotations

import sys

import torch
import torch.distributed.checkpoint as dcp
from mpi4py import MPI
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

import ftkit


def main() -> None:
    source, out = sys.argv[1], sys.argv[2]
    ftkit.init_torch_distributed(MPI.COMM_WORLD, backend="gloo", timeout_s=120)
    mesh = init_device_mesh("cpu", (2,))
    full = torch.load(source, weights_only=True)
    model = {name: distribute_tensor(t, mesh, [Shard(0) if t.dim() and t.shape[0] % 2 == 0
                                               else Replicate()])
             for name, t in full.items()}
    dcp.save({"model": model}, checkpoint_id=out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
