"""Small GPT trained with DP x TP x PP (gloo on CPU), checkpointed with ftkit.

    ftkit run -n 8 --ranks-per-node 2 -- python examples/hp_gpt.py --tp 2 --pp 2

Layout: rank = pp_idx*(dp*tp) + dp_idx*tp + tp_idx (ftkit/Megatron order). Pre-LN transformer
blocks are split evenly across pipeline stages, with a replicated embedding and LM head:
token + position embedding on the first stage, final LayerNorm + untied LM head on the last.
Tensor parallelism is Megatron style: QKV and MLP-up column-parallel (attention heads split
across TP ranks), attention output and MLP-down row-parallel (bias added once after the
all-reduce), LayerNorms replicated, no dropout. The pipeline runs a GPipe schedule (every
micro-batch forward, then every backward in reverse) with send/recv between stages.

Every rank builds each layer's FULL weights from (seed, parameter name) and keeps its TP
slice (declared to ftkit with ``ftkit.declare_shard``, so ``ftkit export`` assembles the
global tensors of any layout; layers are named by their global index), and the global batch of step k is a pure function of (seed, k), so every layout starts
from the same model, sees the same data and computes the same losses (up to float summation
order). With ftkit checkpoints (model, Adam, RNGs, loader position) a killed and relaunched
run ends bit-identical to a failure-free one of the same layout.
Output (rank 0): JSON lines ``start``, one ``step`` per step, then
``{"event": "done", "step": S, "loss": L, "digest": D, "digest_parts": {...}, "timing": ...}``
where D is a sha256 over every rank's whole checkpointed state (parameters, Adam state, every
RNG, loader position; see ``_digest.py``; Python's and NumPy's global generators are seeded
per rank so it is reproducible) and ``digest_parts`` the same per part.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import random
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import emit, init_torch_distributed
from _digest import state_digest

import ftkit

Group = Any   # torch.distributed ProcessGroup (None = the default, world group)


@dataclasses.dataclass(frozen=True)
class Par:
    """This rank's place in the DP x TP x PP grid and its torch.distributed groups."""

    dp: int
    tp: int
    pp: int
    dp_idx: int
    tp_idx: int
    pp_idx: int
    world: Group
    tp_group: Group
    dp_group: Group
    pp_group: Group
    prev: int | None          # global rank of the previous stage (same dp/tp), None if first
    next: int | None          # global rank of the next stage, None if last
    device: torch.device


# ------------------------------------------------------------------------ parallel setup
def rank_of(dp: int, tp: int, d: int, t: int, p: int) -> int:
    return p * dp * tp + d * tp + t


def build_par(topo: ftkit.Topology, device: torch.device) -> Par:
    """Create TP, DP and PP groups (every rank creates every group, in the same order)."""
    dp, tp, pp = topo.dp, topo.tp, topo.pp
    c = topo.coords
    assert rank_of(dp, tp, c.dp, c.tp, c.pp) == topo.rank, "unexpected topology order"
    backend = "nccl" if device.type == "cuda" else None
    members = {
        "tp": [[rank_of(dp, tp, d, t, p) for t in range(tp)]
               for p in range(pp) for d in range(dp)],
        "dp": [[rank_of(dp, tp, d, t, p) for d in range(dp)]
               for p in range(pp) for t in range(tp)],
        "pp": [[rank_of(dp, tp, d, t, p) for p in range(pp)]
               for d in range(dp) for t in range(tp)],
    }
    mine: dict[str, Group] = {}
    for kind, groups in members.items():
        for ranks in groups:
            group = dist.new_group(ranks, backend=backend)
            if topo.rank in ranks:
                mine[kind] = group
    world = dist.new_group(list(range(topo.world)), backend=backend) if backend else None
    prev = rank_of(dp, tp, c.dp, c.tp, c.pp - 1) if c.pp > 0 else None
    nxt = rank_of(dp, tp, c.dp, c.tp, c.pp + 1) if c.pp < pp - 1 else None
    return Par(dp, tp, pp, c.dp, c.tp, c.pp, world, mine["tp"], mine["dp"], mine["pp"],
               prev, nxt, device)


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient over the TP group."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward over the TP group, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Group) -> Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def copy_to_tp(x: Tensor, par: Par) -> Tensor:
    return _CopyToTP.apply(x, par.tp_group) if par.tp > 1 else x


def reduce_from_tp(x: Tensor, par: Par) -> Tensor:
    return _ReduceFromTP.apply(x, par.tp_group) if par.tp > 1 else x


# ------------------------------------------------------------------------------- model
@dataclasses.dataclass(frozen=True)
class Cfg:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    seed: int


def full_init(seed: int, name: str, shape: tuple[int, ...], std: float) -> Tensor:
    """The FULL (unsharded) weight ``name``, drawn from a generator seeded by (seed, name)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return torch.randn(shape, generator=gen) * std


def shard(full: Tensor, par: Par, dim: int, parts: int = 1) -> nn.Parameter:
    """This rank's TP slice along ``dim``; ``parts`` > 1 slices each of the fused blocks
    (q, k, v) separately so that each rank keeps whole heads of all three. Declared to
    ftkit as that piece of ``full`` (one chunk per block), so a checkpoint can be exported
    whole or restored on another layout."""
    assert parts == 1 or dim == 0, "fused blocks are stacked along dim 0"
    blocks = full.chunk(parts, dim=dim)
    param = nn.Parameter(torch.cat([b.chunk(par.tp, dim=dim)[par.tp_idx] for b in blocks],
                                   dim))
    block = full.shape[dim] // parts
    piece = block // par.tp
    sizes = [piece if d == dim else n for d, n in enumerate(full.shape)]
    return ftkit.declare_shard(param, full.shape, chunks=[
        ([k * block + par.tp_idx * piece if d == dim else 0 for d in range(full.ndim)], sizes)
        for k in range(parts)])


class Block(nn.Module):
    """Pre-LN transformer block with Megatron tensor parallelism over ``par.tp_group``."""

    def __init__(self, cfg: Cfg, par: Par, layer: int) -> None:
        super().__init__()
        h, name = cfg.hidden, f"blocks.{layer}."
        out_std = 0.02 / math.sqrt(2 * cfg.layers)
        self.par, self.local_heads = par, cfg.heads // par.tp
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv_w = shard(full_init(cfg.seed, name + "qkv_w", (3 * h, h), 0.02), par, 0, 3)
        self.qkv_b = shard(torch.zeros(3 * h), par, 0, 3)
        self.proj_w = shard(full_init(cfg.seed, name + "proj_w", (h, h), out_std), par, 1)
        self.proj_b = nn.Parameter(torch.zeros(h))
        self.up_w = shard(full_init(cfg.seed, name + "up_w", (4 * h, h), 0.02), par, 0)
        self.up_b = shard(torch.zeros(4 * h), par, 0)
        self.down_w = shard(full_init(cfg.seed, name + "down_w", (h, 4 * h), out_std), par, 1)
        self.down_b = nn.Parameter(torch.zeros(h))

    def attention(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        qkv = F.linear(copy_to_tp(x, self.par), self.qkv_w, self.qkv_b)
        q, k, v = qkv.view(b, s, 3, self.local_heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = F.linear(y.transpose(1, 2).reshape(b, s, -1), self.proj_w)
        return reduce_from_tp(y, self.par) + self.proj_b

    def mlp(self, x: Tensor) -> Tensor:
        y = F.gelu(F.linear(copy_to_tp(x, self.par), self.up_w, self.up_b))
        return reduce_from_tp(F.linear(y, self.down_w), self.par) + self.down_b

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Stage(nn.Module):
    """One pipeline stage: [embedding] + its blocks + [final LayerNorm and LM head]."""

    def __init__(self, cfg: Cfg, par: Par) -> None:
        super().__init__()
        per = cfg.layers // par.pp
        first = par.pp_idx * per
        self.embed: nn.ParameterDict | None = None
        self.head: nn.ParameterDict | None = None
        if par.prev is None:
            self.embed = nn.ParameterDict({
                "tok": nn.Parameter(full_init(cfg.seed, "embed.tok", (cfg.vocab, cfg.hidden),
                                              0.02)),
                "pos": nn.Parameter(full_init(cfg.seed, "embed.pos", (cfg.seq, cfg.hidden),
                                              0.01))})
        self.blocks = nn.ModuleDict({str(i): Block(cfg, par, i)
                                     for i in range(first, first + per)})
        if par.next is None:
            self.ln_f = nn.LayerNorm(cfg.hidden)
            self.head = nn.ParameterDict({
                "w": nn.Parameter(full_init(cfg.seed, "head.w", (cfg.vocab, cfg.hidden), 0.02))})

    def forward(self, x: Tensor) -> Tensor:
        if self.embed is not None:
            x = F.embedding(x, self.embed["tok"]) + self.embed["pos"][: x.shape[1]]
        for block in self.blocks.values():
            x = block(x)
        return x

    def loss(self, h: Tensor, targets: Tensor, denom: int) -> Tensor:
        """Summed next-token cross entropy / ``denom`` (last stage only)."""
        assert self.head is not None
        logits = F.linear(self.ln_f(h), self.head["w"])
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
        return ce / denom


# -------------------------------------------------------------------------------- data
class Loader:
    """Synthetic language from a seeded sparse Markov chain; resumable, state = step.

    The global batch of step k depends only on (seed, k); DP rank d takes its contiguous
    slice of it and splits that into micro-batches.
    """

    SUCCESSORS = (0.55, 0.25, 0.12, 0.08)   # probabilities of each token's likely successors

    def __init__(self, seed: int, vocab: int, seq: int, global_batch: int, par: Par,
                 micro_batches: int) -> None:
        self.seed, self.vocab, self.seq, self.global_batch = seed, vocab, seq, global_batch
        self.local = global_batch // par.dp
        self.dp_idx, self.micro_batches, self.device = par.dp_idx, micro_batches, par.device
        table = np.random.default_rng([seed, 1])
        self.succ = table.integers(0, vocab, (vocab, len(self.SUCCESSORS)))
        self.cum = np.cumsum(self.SUCCESSORS)
        self.step = 0

    def batch(self, k: int) -> np.ndarray:
        """Global batch of step ``k``: (global_batch, seq + 1) token ids (pure)."""
        g = np.random.default_rng([self.seed, 2, k])
        out = np.empty((self.global_batch, self.seq + 1), dtype=np.int64)
        out[:, 0] = g.integers(0, self.vocab, self.global_batch)
        pick = np.minimum((g.random((self.global_batch, self.seq))[..., None] > self.cum)
                          .sum(-1), len(self.cum) - 1)
        for t in range(self.seq):
            out[:, t + 1] = self.succ[out[:, t], pick[:, t]]
        return out

    def next(self) -> list[tuple[Tensor, Tensor]]:
        """This DP rank's (inputs, targets) micro-batches of the next step."""
        mine = self.batch(self.step)[self.dp_idx * self.local:(self.dp_idx + 1) * self.local]
        self.step += 1
        tokens = torch.from_numpy(mine).to(self.device)
        return [(mb[:, :-1], mb[:, 1:]) for mb in tokens.chunk(self.micro_batches)]

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step = int(sd["step"])


# ---------------------------------------------------------------------------- training
def stage_forward(model: Stage, par: Par, tokens: Tensor, targets: Tensor, denom: int,
                  shape: tuple[int, ...]) -> tuple[Tensor | None, Tensor]:
    """Forward of one micro-batch; returns (received input or None, loss or output)."""
    if par.prev is None:
        inp, h = None, model(tokens)
    else:
        inp = torch.empty(shape, device=par.device)
        dist.recv(inp, par.prev, group=par.world)
        h = model(inp.requires_grad_())
    if par.next is None:
        return inp, model.loss(h, targets, denom)
    dist.send(h.detach().contiguous(), par.next, group=par.world)
    return inp, h


def stage_backward(par: Par, inp: Tensor | None, out: Tensor, shape: tuple[int, ...]) -> None:
    if par.next is None:
        out.backward()
    else:
        grad = torch.empty(shape, device=par.device)
        dist.recv(grad, par.next, group=par.world)
        out.backward(grad)
    if inp is not None:
        assert inp.grad is not None
        dist.send(inp.grad.contiguous(), par.prev, group=par.world)


def allreduce_dp_grads(model: Stage, par: Par) -> None:
    """Sum gradients over the DP group in one flat buffer."""
    if par.dp == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=par.dp_group)
    for g, new in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(new.view_as(g))


def train_step(model: Stage, opt: torch.optim.Optimizer, par: Par, cfg: Cfg,
               micro: list[tuple[Tensor, Tensor]], global_batch: int) -> float:
    """GPipe step (all forwards, then all backwards in reverse); returns the global loss."""
    opt.zero_grad()
    denom = global_batch * cfg.seq
    shape = (micro[0][0].shape[0], cfg.seq, cfg.hidden)
    saved = [stage_forward(model, par, x, y, denom, shape) for x, y in micro]
    for inp, out in reversed(saved):
        stage_backward(par, inp, out, shape)
    allreduce_dp_grads(model, par)
    opt.step()
    total = torch.zeros(1, dtype=torch.float64, device=par.device)
    if par.next is None and par.tp_idx == 0:
        total += sum(float(out.detach()) for _, out in saved)
    dist.all_reduce(total, group=par.world)
    return float(total.item())


# ------------------------------------------------------------------------------- setup
def parse_args(world: int) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=0, help="default: world / (tp*pp)")
    for name, default in (("tp", 1), ("pp", 1), ("layers", 4), ("hidden", 64),
                          ("heads", 4), ("steps", 40), ("seed", 0), ("micro-batches", 2),
                          ("global-batch", 16), ("seq", 32), ("vocab", 128)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto: cuda (nccl) when available, else cpu (gloo)")
    ap.add_argument("--init-from", metavar="DCP_DIR",
                    help="a torch.distributed.checkpoint directory whose model.* tensors "
                         "seed the model when the job has no checkpoint yet (any layout)")
    args = ap.parse_args()
    if min(args.tp, args.pp) < 1 or world % (args.tp * args.pp):
        ap.error(f"the world size {world} is not divisible by tp*pp = {args.tp}*{args.pp}")
    args.dp = args.dp or world // (args.tp * args.pp)
    problems = [
        (args.dp * args.tp * args.pp != world,
         f"dp*tp*pp = {args.dp}*{args.tp}*{args.pp} must equal the world size {world}"),
        (args.layers % args.pp != 0, f"--layers {args.layers} not divisible by --pp {args.pp}"),
        (args.heads % args.tp != 0, f"--heads {args.heads} not divisible by --tp {args.tp}"),
        (args.hidden % args.heads != 0, f"--hidden {args.hidden} not divisible by --heads"),
        (args.micro_batches < 1 or args.global_batch % (args.dp * args.micro_batches) != 0,
         (f"--global-batch {args.global_batch} must be a multiple of dp*micro-batches "
          f"= {args.dp}*{args.micro_batches} (micro-batches >= 1)")),
    ]
    for bad, message in problems:
        if bad:
            ap.error(message)
    return args


def pick_device(choice: str, comm: MPI.Comm) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    device = torch.device("cuda", local.Get_rank() % torch.cuda.device_count())
    local.Free()
    torch.cuda.set_device(device)
    return device


def timing(comm: MPI.Comm, iters: list[float], blocked: list[float], state_bytes: int
           ) -> dict[str, float]:
    """Median (= p50) and 99th percentile of the iteration times (the first two, warm-up,
    left out), training-loop blocking per step over all steps, and the checkpointed tensor
    bytes: slowest / largest rank. Collective over ``comm``."""
    steady = iters[2:] or iters
    iter_s = float(np.median(steady)) if steady else 0.0
    p99 = float(np.percentile(steady, 99)) if steady else 0.0
    per_step = sum(blocked) / max(1, len(iters))
    return {"iter_s": comm.allreduce(iter_s, op=MPI.MAX),
            "iter_p99_s": comm.allreduce(p99, op=MPI.MAX),
            "blocked_s_per_step": comm.allreduce(per_step, op=MPI.MAX),
            "state_mib": comm.allreduce(state_bytes, op=MPI.MAX) / 2**20}


def tensor_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of parameters and optimizer state (what a checkpoint of this rank stages)."""
    tensors = [*model.parameters(), *(v for st in opt.state.values() for v in st.values()
                                      if isinstance(v, Tensor))]
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    # in-job recovery (ftkit run --in-job) calls train again, in the same processes, after
    # spare ranks took the places of failed ones; otherwise it runs once on COMM_WORLD
    ftkit.resilient(train)


def train(comm: MPI.Comm) -> None:
    """Build everything that talks to other ranks from ``comm``, restore, train."""
    args = parse_args(comm.size)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    random.seed(args.seed * 1000 + comm.rank + 1)     # covered by the digest: reproducible
    np.random.seed(args.seed * 1000 + comm.rank + 1)
    device = pick_device(args.device, comm)
    topo = ftkit.Topology.create(comm, tp=args.tp, pp=args.pp)
    init_torch_distributed(comm)       # gloo world group; nccl subgroups on top for cuda
    par = build_par(topo, device)
    cfg = Cfg(args.layers, args.hidden, args.heads, args.seq, args.vocab, args.seed)
    model = Stage(cfg, par).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loader = Loader(args.seed, args.vocab, args.seq, args.global_batch, par, args.micro_batches)
    state = {"model": model, "optim": opt, "rng": ftkit.RNGState(), "data": loader}

    ckpt = ftkit.Checkpointer(topo)
    start = ckpt.restore(state, init_from=args.init_from)
    assert loader.step == start, f"loader at step {loader.step} after restoring step {start}"
    emit(comm, event="start", step=start, attempt=ckpt.config.attempt,
         layout={"dp": par.dp, "tp": par.tp, "pp": par.pp})
    loss = float("nan")
    iters: list[float] = []
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        loss = train_step(model, opt, par, cfg, loader.next(), args.global_batch)
        emit(comm, event="step", step=step + 1, loss=loss)
        ckpt.save(step + 1, state)
        iters.append(time.perf_counter() - t0)
    ckpt.close()
    digest, parts = state_digest(comm, state)
    emit(comm, event="done", step=args.steps, loss=loss, digest=digest, digest_parts=parts,
         timing=timing(comm, iters, ckpt.blocked_seconds, tensor_bytes(model, opt)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
