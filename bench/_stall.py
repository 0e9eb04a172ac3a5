"""The training stall of a checkpoint that goes to the PFS, ftkit next to DCP ``async_save``.

Measured on a training state, not on loose tensors: an MLP and its Adam optimizer
(parameters and both moments: about ``nbytes`` per rank), trained by a real loop. Each round
is one training iteration that starts with a checkpoint, as a loop that saves at the end of
step ``k`` and then runs step ``k + 1``:

* ``ftkit_pfs_stall``: every second the iteration was blocked by ftkit
  (``Checkpointer.blocked_seconds``: ``save`` until it returns, *plus* the wait in the next
  ``optimizer.step()`` for the parameters' and moments' background copy, if it had not
  landed yet), of an asynchronous Checkpointer with ``local:1,pfs:1`` (every step goes to
  the PFS; the flush runs behind the loop);
* ``torch_dcp_async_save_blocking``: the time ``dcp.async_save`` of the same state (model and
  optimizer state dicts, taken once: they reference the live tensors) takes to return;
* ``iteration_plain`` / ``iteration_ftkit_pfs_save`` / ``iteration_dcp_async_save``: the
  whole iteration (barrier to barrier) without a checkpoint, with ftkit's, with DCP's: the
  cost a user feels, background writers' competition for the cores included.

The three kinds of round alternate; between rounds both tools' background work is waited
for (untimed), so each round starts with an idle disk and no flush in flight (checkpoints
far apart, as they are in training). Max over ranks. Untimed first: :data:`WARM_FTKIT`
ftkit rounds and one DCP round.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

#: rows of the training batch
BATCH = 16
#: untimed ftkit rounds first: each of the node-local slots the saves alternate between is
#: made (its memory first touched) once, so the timed rounds measure the steady state
WARM_FTKIT = 2


@dataclasses.dataclass
class Trainer:
    """One rank's model, optimizer and batch, and one training iteration of them."""

    model: Any
    opt: Any
    batch: Any

    def iteration(self) -> None:
        """Forward, backward, ``optimizer.step()`` (where ftkit's guard waits)."""
        self.opt.zero_grad()
        self.model(self.batch).square().mean().backward()
        self.opt.step()


def trainer(rank: int, nbytes: int) -> Trainer:
    """An MLP whose parameters and Adam moments take about ``nbytes`` (at least one layer),
    stepped once so the moments exist."""
    import torch

    width = 1024 if nbytes >= 48 << 20 else 64
    layer_bytes = (width * width + width) * 4
    layers = max(1, nbytes // (3 * layer_bytes))          # parameters + two moments
    torch.manual_seed(2000 + rank)
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*mods)
    t = Trainer(model, torch.optim.Adam(model.parameters(), lr=1e-4),
                torch.randn(BATCH, width))
    t.iteration()
    return t


def state_bytes(t: Trainer) -> int:
    """Bytes of the parameters and the optimizer state (what both tools save)."""
    import torch
    params = sum(p.numel() * p.element_size() for p in t.model.parameters())
    moments = sum(v.numel() * v.element_size() for s in t.opt.state.values()
                  for v in s.values() if isinstance(v, torch.Tensor))
    return params + moments


def measure(run: Any, repeat: int, timed: Callable[..., float], rm: Callable[..., None]
            ) -> None:
    """The three kinds of round, alternating, ``repeat`` times; records into ``run`` (see
    the module doc; a DCP that cannot ``async_save`` here is recorded in ``run.skipped``
    and only ftkit is measured). ``timed``/``rm``: the benchmark's barrier-timed call and
    collective remove. All ranks call."""
    import torch.distributed.checkpoint as dcp
    from mpi4py import MPI
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ftkit import Checkpointer
    rank, comm = run.comm.rank, run.comm
    t = trainer(rank, run.stall_bytes)
    run.stall_trained = state_bytes(t)
    state = {f"r{rank}": {"model": t.model, "optim": t.opt}}
    model_sd, optim_sd = get_state_dict(t.model, t.opt)
    plain = {f"r{rank}": {"model": model_sd, "optim": optim_sd}}
    cfg = dataclasses.replace(run.cfg, async_=True, job=run.cfg.job + "-train")
    ckpt = Checkpointer(run.topo, cfg)

    def ftkit_round(step: int) -> None:
        n0 = len(ckpt.blocked_seconds)
        run.add("iteration_ftkit_pfs_save", timed(comm, lambda: (ckpt.save(step, state),
                                                                 t.iteration())))
        run.add("ftkit_pfs_stall", comm.allreduce(sum(ckpt.blocked_seconds[n0:]),
                                                  op=MPI.MAX))
        ckpt.wait()

    def dcp_round(i: int) -> None:
        d, blocked, pending = run.pfs_root / f"train-dcp-{i}", [0.0], []

        def iteration() -> None:
            t0 = time.perf_counter()
            pending.append(dcp.async_save(plain, storage_writer=dcp.FileSystemWriter(d)))
            blocked[0] = time.perf_counter() - t0
            t.iteration()
        run.add("iteration_dcp_async_save", timed(comm, iteration))
        run.add("torch_dcp_async_save_blocking", comm.allreduce(blocked[0], op=MPI.MAX))
        res = pending[0]
        (res if hasattr(res, "result") else res.upload_completion).result()
        rm(comm, d)
    try:
        for step in range(1, WARM_FTKIT + 1):   # untimed warm-up of both: slots, planner
            ftkit_round(step)
        try:
            dcp_round(0)
        except Exception as exc:  # noqa: BLE001 - a peer that does not work here
            run.skipped["torch_dcp_async_save_blocking"] = f"{type(exc).__name__}: {exc}"
        run.forget("iteration_ftkit_pfs_save", "ftkit_pfs_stall", "iteration_dcp_async_save",
                   "torch_dcp_async_save_blocking")
        for i in range(repeat):
            run.add("iteration_plain", timed(comm, t.iteration))
            ftkit_round(i + WARM_FTKIT + 1)
            if "torch_dcp_async_save_blocking" not in run.skipped:
                dcp_round(i + 1)
    finally:
        ckpt.close()
    rm(comm, cfg.job_pfs_dir, cfg.job_local_dir)
