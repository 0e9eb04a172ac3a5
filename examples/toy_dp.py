"""Toy data-parallel MLP training with ftkit checkpoints (deterministic, CPU).

    ftkit run -n 4 -- python examples/toy_dp.py --steps 20 --seed 1

Gradients are all-reduced with torch.distributed (gloo) initialised from the MPI ranks.
Each step's global batch comes from a seeded, resumable loader whose position, the model,
the Adam state and every RNG (dropout uses torch's generator) are checkpointed, so a run
that is killed and relaunched ends bit-identical to a failure-free one.
Python's ``random`` and NumPy's global generator are seeded per rank too and draw a little
every step (as an augmentation pipeline would), so a resume that does not restore them shows.
Output: one JSON line per step on rank 0, last line ``{"event": "done", "step": S, "loss": L,
"digest": D, "digest_parts": {...}}``: D is a sha256 over every rank's whole checkpointed
state (parameters, Adam state, every RNG, loader position; see ``_digest.py``), and
``digest_parts`` the same per part (model, optim, rng, data) to tell which one differs.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emit, init_torch_distributed
from _digest import state_digest
from _loader import Loader

import ftkit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--dropout", type=float, default=0.1,
                    help="dropout draws from each rank's torch RNG (0: layout-independent)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    # in-job recovery (ftkit run --in-job) calls train again, in the same processes, after
    # spare ranks took the places of failed ones; otherwise it runs once on COMM_WORLD
    ftkit.resilient(lambda comm: train(args, comm))


def train(args: argparse.Namespace, comm: MPI.Comm) -> None:
    """Build everything that talks to other ranks from ``comm``, restore, train."""
    init_torch_distributed(comm)
    torch.manual_seed(args.seed)                      # identical replicas
    model = torch.nn.Sequential(torch.nn.Linear(16, args.hidden), torch.nn.ReLU(),
                                torch.nn.Dropout(args.dropout), torch.nn.Linear(args.hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    rank_seed = args.seed * 1000 + comm.rank + 1
    torch.manual_seed(rank_seed)                       # per-rank dropout stream
    random.seed(rank_seed)
    np.random.seed(rank_seed)
    loader = Loader(args.seed)
    state = {"model": model, "optim": opt, "rng": ftkit.RNGState(), "data": loader}

    topo = ftkit.Topology.create(comm)
    ckpt = ftkit.Checkpointer(topo)
    start = ckpt.restore(state)
    emit(comm, event="start", step=start, attempt=ckpt.config.attempt)
    loss_val = float("nan")
    for step in range(start, args.steps):
        x, y = (torch.from_numpy(a) for a in loader.next(comm.rank, comm.size))
        random.random(), np.random.random()            # the host-side generators advance
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad.div_(comm.size)
        opt.step()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        loss_val = total.item() / comm.size
        emit(comm, event="step", step=step + 1, loss=loss_val)
        ckpt.save(step + 1, state)
    ckpt.close()
    digest, parts = state_digest(comm, state)
    emit(comm, event="done", step=args.steps, loss=loss_val, digest=digest, digest_parts=parts)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
