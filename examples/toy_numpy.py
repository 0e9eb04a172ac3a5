"""Toy data-parallel training in NumPy and mpi4py, with ftkit checkpoints (no torch).

    ftkit run -n 4 -- python examples/toy_numpy.py --steps 20 --seed 1

The same job as ``toy_dp.py`` for codes that are MPI and NumPy only: a two-layer network
(tanh hidden layer) trained by Adam written in NumPy, its gradients summed over the ranks
with ``MPI.Allreduce``. Each rank adds a little noise to its gradients from NumPy's global
generator, seeded per rank (the part dropout plays in ``toy_dp.py``), and draws from Python's
``random`` every step, so a resume that does not restore the generators shows. The arrays
are updated in place: the checkpointed state holds the live arrays, and ftkit restores
into them. Checkpointed: parameters, Adam moments and step count, every generator
(:class:`ftkit.RNGState`), the loader's position.

Output: as ``toy_dp.py`` (one JSON line per step on rank 0; the last one ``{"event":
"done", ..., "digest": D, "digest_parts": {...}}``). The process never imports torch; the
end-to-end protocol fault matrix and the redundancy tests run this example
(tests/e2e/test_fault_matrix.py, tests/e2e/test_redundancy.py): it starts in ~2 s where the
torch toy takes ~9 s on 2 cores.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emit
from _digest import state_digest
from _loader import Loader

import ftkit

Arrays = dict[str, np.ndarray]


def init_params(seed: int, dim: int = 16, hidden: int = 32) -> Arrays:
    """Identical on every rank (seeded by ``seed`` only)."""
    g = np.random.default_rng((seed, 7))
    return {"w1": 0.3 * g.standard_normal((dim, hidden)), "b1": np.zeros(hidden),
            "w2": 0.3 * g.standard_normal((hidden, 1)), "b2": np.zeros(1)}


def local_grads(p: Arrays, x: np.ndarray, y: np.ndarray) -> tuple[float, Arrays]:
    """(sum of squared errors, its gradients) over this rank's rows."""
    h = np.tanh(x @ p["w1"] + p["b1"])
    err = h @ p["w2"] + p["b2"] - y
    d_out = 2.0 * err
    d_h = (d_out @ p["w2"].T) * (1.0 - h * h)
    grads = {"w1": x.T @ d_h, "b1": d_h.sum(0), "w2": h.T @ d_out, "b2": d_out.sum(0)}
    return float((err * err).sum()), grads


def mean_over_ranks(comm: MPI.Comm, sse: float, grads: Arrays, noise: float,
                    batch: int) -> tuple[float, Arrays]:
    """(mean loss, mean gradients) over the global batch of ``batch`` rows: this rank's
    gradients, plus ``noise`` times draws of NumPy's global generator, and its squared
    error summed over every rank in one ``Allreduce``. Every rank of ``comm`` calls."""
    names = sorted(grads)
    flat = np.concatenate([grads[k].ravel() for k in names] + [np.array([sse])])
    flat[:-1] += noise * np.random.standard_normal(flat.size - 1)
    comm.Allreduce(MPI.IN_PLACE, flat)
    flat /= batch
    out, offset = {}, 0
    for k in names:
        out[k] = flat[offset:offset + grads[k].size].reshape(grads[k].shape)
        offset += grads[k].size
    return float(flat[-1]), out


def adam_step(p: Arrays, g: Arrays, opt: dict[str, Arrays], lr: float = 1e-2,
              b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> None:
    """One Adam update of ``p`` in place; ``opt`` holds the moments and the step count."""
    opt["t"] += 1
    t = int(opt["t"][0])
    for k in p:
        m, v = opt["m"][k], opt["v"][k]
        m *= b1
        m += (1 - b1) * g[k]
        v *= b2
        v += (1 - b2) * g[k] * g[k]
        p[k] -= lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", type=float, default=1e-3,
                    help="per-rank gradient noise from NumPy's global generator")
    args = ap.parse_args()
    ftkit.resilient(lambda comm: train(args, comm))


def train(args: argparse.Namespace, comm: MPI.Comm) -> None:
    """Build everything that talks to other ranks from ``comm``, restore, train."""
    params = init_params(args.seed)
    opt = {"m": {k: np.zeros_like(a) for k, a in params.items()},
           "v": {k: np.zeros_like(a) for k, a in params.items()},
           "t": np.zeros(1, dtype=np.int64)}
    rank_seed = args.seed * 1000 + comm.rank + 1
    random.seed(rank_seed)
    np.random.seed(rank_seed)
    loader = Loader(args.seed)
    state = {"model": params, "optim": opt, "rng": ftkit.RNGState(), "data": loader}

    ckpt = ftkit.Checkpointer(ftkit.Topology.create(comm))
    start = ckpt.restore(state)
    emit(comm, event="start", step=start, attempt=ckpt.config.attempt)
    loss = float("nan")
    for step in range(start, args.steps):
        x, y = (a.astype(np.float64) for a in loader.next(comm.rank, comm.size))
        random.random()
        loss, grads = mean_over_ranks(comm, *local_grads(params, x, y), args.noise,
                                      loader.batch)
        adam_step(params, grads, opt)
        emit(comm, event="step", step=step + 1, loss=loss)
        ckpt.save(step + 1, state)
    ckpt.close()
    digest, parts = state_digest(comm, state)
    emit(comm, event="done", step=args.steps, loss=loss, digest=digest, digest_parts=parts)


if __name__ == "__main__":
    main()
