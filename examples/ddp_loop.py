"""A PyTorch user's own training loop, made fault tolerant: DDP (gloo, its defaults), AdamW
with a warmup + cosine LR schedule, an EMA of the weights (AveragedModel), an MLP with
dropout, torchdata's StatefulDataLoader over a DistributedSampler, an eval pass with dropout
off every 8 steps (the README's loop, with what a real script adds).

    ftkit run -n 2 -- python examples/ddp_loop.py --steps 40 [--workers 2] [--generator]

Killed anywhere (mid-epoch included) and relaunched, or recovered in the job
(``ftkit run --in-job --spares 2``), it ends bit-identical to an uninterrupted run: the last
line ``{"event": "done", ..., "digest": D, "digest_parts": {...}}`` covers the model, the
optimizer state, the schedule, the EMA, every generator and the loader (see ``_digest.py``).
``--workers``: the loader's worker processes; ``--generator``: give the loader a generator of
its own (without one, ftkit gives it one at ``restore()``, so its base-seed draws leave
torch's global generator alone); ``--plain``: a plain ``torch.utils.data.DataLoader``, which
``restore()`` refuses before the first step (it cannot resume mid-epoch); ``--context``: the
workers' start method (``forkserver``, ``spawn``: each worker imports this script again, its
``from mpi4py import MPI`` included).

``save`` comes last in the iteration, after eval: the eval loader draws its base seed from
torch's global generator, and a run resumed from a save made before that draw would not make
it. The scheduler and the EMA are in the state: left out, a resumed run would start them over.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emit, init_torch_distributed
from _digest import state_digest

import ftkit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--generator", action="store_true")
    ap.add_argument("--plain", action="store_true",
                    help="a plain torch DataLoader (ftkit refuses it before the first step)")
    ap.add_argument("--context", choices=("fork", "forkserver", "spawn"), default=None,
                    help="the loader workers' start method (default: Python's)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    # in-job recovery (ftkit run --in-job) calls train again, in the same processes, after
    # spare ranks took the places of failed ones; otherwise it runs once on COMM_WORLD
    ftkit.resilient(lambda comm: train(args, comm))


def train(args: argparse.Namespace, comm: MPI.Comm) -> None:
    """Build everything that talks to other ranks from ``comm``, restore, train."""
    init_torch_distributed(comm)
    torch.manual_seed(args.seed)
    x = torch.randn(512, 16)
    y = torch.tanh(x @ torch.randn(16, 1)) + 0.05 * torch.randn(512, 1)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=comm.size, rank=comm.rank, shuffle=True,
                                 seed=args.seed)
    generator = torch.Generator().manual_seed(args.seed) if args.generator else None
    make = torch.utils.data.DataLoader if args.plain else StatefulDataLoader
    loader = make(data, batch_size=16, sampler=sampler, num_workers=args.workers,
                  generator=generator,
                  multiprocessing_context=args.context if args.workers else None)
    held_out = torch.utils.data.DataLoader(TensorDataset(x[:64], y[:64]), batch_size=32,
                                           shuffle=True)       # draws from torch's generator
    model = DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 8) * 0.5 * (1 + math.cos(math.pi * min(s, 80) / 80)))
    ema = torch.optim.swa_utils.AveragedModel(
        model.module, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    torch.manual_seed(args.seed * 1000 + comm.rank)        # per-rank dropout
    random.seed(args.seed * 1000 + comm.rank)              # what else a loop may draw from
    np.random.seed(args.seed * 1000 + comm.rank)

    ckpt = ftkit.Checkpointer(ftkit.Topology.create(comm))
    state = {"model": model, "optim": opt, "sched": sched, "ema": ema,
             "rng": ftkit.RNGState(), "data": loader}
    step = ckpt.restore(state)
    emit(comm, event="start", step=step, attempt=ckpt.config.attempt)
    while step < args.steps:
        sampler.set_epoch(step // len(loader))
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            ema.update_parameters(model.module)
            step += 1
            if step % 8 == 0:
                emit(comm, event="eval", step=step, loss=evaluate(model, held_out))
            emit(comm, event="step", step=step, loss=loss.item())
            ckpt.save(step, state)        # last: after eval and logging
            if step >= args.steps:
                break
    ckpt.close()
    digest, parts = state_digest(comm, state)
    emit(comm, event="done", step=step, digest=digest, digest_parts=parts)
    dist.destroy_process_group()


def evaluate(model: torch.nn.Module, loader: torch.utils.data.DataLoader) -> float:
    """Mean loss over ``loader`` with dropout off (its shuffle draws from torch's global
    generator)."""
    model.eval()
    with torch.no_grad():
        losses = [torch.nn.functional.mse_loss(model(xb), yb).item() for xb, yb in loader]
    model.train()
    return sum(losses) / len(losses)


if __name__ == "__main__":
    main()
