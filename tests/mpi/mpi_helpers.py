"""Helpers shared by the MPI-tier tests (a plain module; pytest does not collect it).

``canon`` turns a live training state into a canonical, comparable form in which every
tensor and array is represented by its dtype, shape and raw bytes, so "equal" means
bit-identical (NaN payloads, -0.0 and all). ``diff`` names the paths where two such forms
differ.
"""
from __future__ import annotations

import contextlib
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

import ftkit
from ftkit.comm.topology import Topology
from ftkit.jobdir.events import read_events

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
SIZE = WORLD.Get_size()


def allgather(obj: Any) -> list[Any]:
    return WORLD.allgather(obj)


def from_rank0(obj: Any) -> Any:
    """``obj`` as computed on rank 0, on every rank."""
    return WORLD.bcast(obj, root=0)


def same_on_all_ranks(obj: Any, what: str) -> Any:
    """Assert ``obj`` is equal on every rank (same assertion everywhere); return it."""
    got = allgather(obj)
    assert all(g == got[0] for g in got), f"{what} differs between ranks: {got!r}"
    return got[0]


@contextlib.contextmanager
def topology(**kwargs: Any) -> Iterator[Topology]:
    topo = Topology.create(WORLD, **kwargs)
    try:
        yield topo
    finally:
        topo.free()


def events(path: Path) -> list[dict[str, Any]]:
    """The job's events.jsonl as read by rank 0, on every rank."""
    return from_rank0(list(read_events(path)) if RANK == 0 else None)


def node_listing(step_dir: Path) -> list[str] | None:
    """Sorted names in a step directory (hidden files included), None if it does not exist."""
    return sorted(p.name for p in step_dir.iterdir()) if step_dir.is_dir() else None


# ---------------------------------------------------------------- canonical form
def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes()


def canon(x: Any) -> Any:
    """Canonical form of a state value; objects with state_dict() by their state_dict."""
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype), tuple(x.shape), _tensor_bytes(x))
    if isinstance(x, np.ndarray):
        return ("ndarray", repr(x.dtype), x.shape, np.ascontiguousarray(x).tobytes())
    if isinstance(x, np.generic):
        return ("npscalar", type(x).__name__, repr(x.dtype), x.tobytes())
    if isinstance(x, bool) or x is None:
        return (type(x).__name__, x)
    if isinstance(x, int):
        return ("int", x)
    if isinstance(x, float):
        return ("float", x.hex())
    if isinstance(x, str):
        return ("str", x)
    if isinstance(x, dict):
        return ("dict", {(type(k).__name__, repr(k)): canon(v) for k, v in x.items()})
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [canon(v) for v in x])
    if hasattr(x, "state_dict"):
        return ("obj", type(x).__name__, canon(x.state_dict()))
    return ("other", type(x).__name__, repr(x))


def diff(want: Any, got: Any, path: str = "", limit: int = 12) -> list[str]:
    """Paths where two canonical forms differ (at most ``limit``)."""
    out: list[str] = []

    def walk(a: Any, b: Any, p: str) -> None:
        if len(out) >= limit:
            return
        if a[0] != b[0] or (a[0] == "obj" and a[1] != b[1]):
            out.append(f"{p or '<root>'}: {a[0]} vs {b[0]}")
            return
        kind = a[0]
        if kind == "dict":
            for k in sorted(set(a[1]) | set(b[1]), key=repr):
                if k not in a[1] or k not in b[1]:
                    out.append(f"{p}/{k[1]}: key {'missing' if k not in b[1] else 'extra'}")
                else:
                    walk(a[1][k], b[1][k], f"{p}/{k[1]}")
        elif kind in ("list", "tuple"):
            if len(a[1]) != len(b[1]):
                out.append(f"{p}: length {len(a[1])} vs {len(b[1])}")
            for i, (u, v) in enumerate(zip(a[1], b[1])):
                walk(u, v, f"{p}/{i}")
        elif kind == "obj":
            walk(a[2], b[2], p)
        elif a != b:
            what = "bytes" if kind in ("tensor", "ndarray", "npscalar") else "value"
            if a[:-1] != b[:-1]:
                what = f"{a[:-1]} vs {b[:-1]}"
            elif kind not in ("tensor", "ndarray", "npscalar"):
                what = f"{a[-1]!r} vs {b[-1]!r}"
            out.append(f"{p or '<root>'}: {what}")

    walk(want, got, path)
    return out


# ------------------------------------------------------------------ test states
_TORCH_DTYPES = ["float16", "bfloat16", "float32", "float64", "complex32", "complex64",
                 "complex128", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                 "uint64", "bool", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                 "float8_e5m2fnuz", "float8_e8m0fnu"]
TORCH_DTYPES = [getattr(torch, n) for n in _TORCH_DTYPES if hasattr(torch, n)]
NUMPY_DTYPES = ["<f2", "<f4", "<f8", "<c8", "<c16", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2",
                "<u4", "<u8", "|b1", ">i4", ">f8", "<U7", "|S5", "<M8[ns]", "<m8[s]"]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator
                  ) -> torch.Tensor:
    """A tensor of arbitrary bit patterns (NaN payloads included); bools are 0/1."""
    n = int(np.prod(shape)) if shape else 1
    size = dtype.itemsize
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def random_array(descr: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    dtype = np.dtype(descr)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    if dtype.kind in "US":
        letters = np.array(list("abcdefgé" if dtype.kind == "U" else "abcdefgh"))
        return np.array(["".join(rng.choice(letters, 4)) for _ in range(int(np.prod(shape)))],
                        dtype=dtype).reshape(shape)
    if dtype.kind in "Mm":
        return rng.integers(-2**40, 2**40, shape).astype(dtype)
    raw = rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def model_and_optimizer(seed: int, step: bool = True) -> tuple[torch.nn.Module,
                                                                 torch.optim.Optimizer]:
    """A small model with buffers (BatchNorm) and an Adam optimizer after one step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.BatchNorm1d(7),
                                torch.nn.ReLU(), torch.nn.Linear(7, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    if step:
        train_step(model, opt)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(6, 5)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def rich_state(rank: int, seed: int) -> dict[str, Any]:
    """A state with every supported kind of leaf; values depend on ``rank`` and ``seed``."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    rng = np.random.default_rng(1000 * seed + rank)
    tensors: dict[str, Any] = {str(dt).removeprefix("torch."): random_tensor(dt, (3, 5), g)
                               for dt in TORCH_DTYPES}
    tensors["specials"] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"),
                                        1e-45, float(rank)], dtype=torch.float32)
    tensors["scalar0d"] = torch.tensor(2.5 + rank, dtype=torch.float64)
    tensors["empty"] = torch.empty((0, 3), dtype=torch.float32)
    tensors["transposed"] = random_tensor(torch.float64, (4, 6), g).t()     # non-contiguous
    tensors["param"] = torch.nn.Parameter(random_tensor(torch.float32, (2, 2), g))
    tensors["conj"] = random_tensor(torch.complex64, (3,), g).conj()
    tensors["big"] = torch.randn(64, 64, generator=g)
    arrays: dict[str, Any] = {descr: random_array(descr, (2, 3), rng) for descr in NUMPY_DTYPES}
    arrays["structured"] = np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8", (2,))])
    arrays["structured"]["a"] = rng.integers(-9, 9, 3)
    arrays["structured"]["b"] = rng.random((3, 2))
    arrays["fortran"] = np.asfortranarray(rng.random((3, 4)))
    arrays["zero_d"] = np.array(rank * 1.25)
    arrays["empty"] = np.empty((2, 0), dtype="<i8")
    arrays["np_f32"] = np.float32(1.5 + rank)
    arrays["np_i64"] = np.int64(-(2**62) + rank)
    arrays["np_bool"] = np.bool_(rank % 2)
    arrays["np_c128"] = np.complex128(complex(rank, -0.0))
    scalars = {"int": 7 * rank - 3, "big": 2**80 + rank, "neg_big": -(2**70) - seed,
               "float": 0.1 * (rank + 1), "nan": float("nan"), "neg_zero": -0.0,
               "inf": float("-inf"), "subnormal": 5e-324, "str": f"rank-{rank} ünï∂e \x00 😀",
               "empty_str": "", "true": True, "false": False, "none": None}
    nested = {"list": [1, (2.5, "x", None), {"deep": [torch.arange(4) + rank, (rank,)]}],
              "tuple": (torch.ones(2) * rank, [np.arange(3) + rank], ()),
              "empty": {"list": [], "dict": {}, "tuple": ()},
              3: "int key", 2.5: "float key", None: "none key", False: "bool key",
              -1e300: "negative float key"}
    model, opt = model_and_optimizer(100 * seed + rank)
    random.seed(seed * 31 + rank)
    np.random.seed(seed * 37 + rank)
    torch.manual_seed(seed * 41 + rank)
    return {"rank": rank, "seed": seed, "tensors": tensors, "numpy": arrays,
            "scalars": scalars, "nested": nested, "model": model, "optim": opt,
            "rng": ftkit.RNGState()}


def mutate(state: dict[str, Any], rank: int) -> None:
    """Change every part of a rich_state: in place, by replacement and structurally."""
    other = rich_state(rank, seed=99)
    with torch.no_grad():
        for name, t in state["tensors"].items():
            if t.dtype.is_floating_point and t.numel() and name.startswith(("float3", "big")):
                t.add_(1.0)                                  # in place
            else:
                state["tensors"][name] = other["tensors"][name]
    state["tensors"]["extra"] = torch.zeros(2)
    del state["tensors"]["bool"]
    for name, a in state["numpy"].items():
        if isinstance(a, np.ndarray) and a.size and a.flags.writeable:
            a[...] = other["numpy"][name]                    # in place
        else:
            state["numpy"][name] = other["numpy"][name]
    state["scalars"] = other["scalars"]
    state["nested"]["list"].append("extra")
    state["nested"]["list"][2]["deep"][0].add_(100)
    state["nested"]["tuple"] = other["nested"]["tuple"]
    state["nested"]["new"] = 1
    del state["nested"][3]
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(1.0)
    train_step(state["model"], state["optim"])
    state["rank"] = -1


def rng_draws() -> tuple[float, list[float], list[float]]:
    """Draw from Python, NumPy and torch global generators (changes their state)."""
    return (random.random(), np.random.random(3).tolist(), torch.rand(3).tolist())


def small_state(rank: int, step: int) -> dict[str, Any]:
    """A compact state whose every value depends on rank and step."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return {"w": torch.randn(4096, generator=g),
            "half": torch.randn(33, generator=g).to(torch.bfloat16),
            "np": np.arange(17, dtype=np.int64) * (step + 1) + rank,
            "meta": {"step": step, "rank": rank, "lr": 0.5 ** step, "tag": ("s", step)}}


def lose_node(env: Any, node: int) -> None:
    """Virtual node ``node``'s directory is gone (rank ``2 * node``, its leader with two ranks
    per node, removes it) once every rank got here. All ranks call."""
    WORLD.Barrier()
    if RANK == 2 * node:
        shutil.rmtree(env.node_dir(node))
    WORLD.Barrier()


def assert_restores(topo: Topology, step: int, levels: str) -> None:
    """A fresh Checkpointer with ``levels`` restores :func:`small_state` of ``step`` on every
    rank. All ranks call."""
    fresh = ftkit.Checkpointer(topo, ftkit.Config.load(levels=levels))
    state = small_state(RANK, 0)
    got = fresh.restore(state)
    fresh.close()
    assert allgather(got) == [step] * WORLD.size
    assert diff(canon(small_state(RANK, step)), canon(state)) == []


def catch(fn: Any, *args: Any, **kwargs: Any) -> Exception | None:
    """Run ``fn``; return the exception it raised (None if none), so that a rank whose
    outcome differs does not leave the others hanging in the next collective."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - compared after the collectives
        return exc
    return None


def error_summary(exc: Exception | None) -> tuple[Any, ...] | None:
    """Comparable summary of a CheckpointError (type, step, failures, message)."""
    if exc is None:
        return None
    failures = getattr(exc, "failures", None)
    return (type(exc).__name__, getattr(exc, "step", None),
            sorted(failures.items()) if failures is not None else None, str(exc))


def save_steps(topo: Topology, steps: list[int], **overrides: Any) -> dict[int, Any]:
    """Save ``steps`` of :func:`small_state` (sync) in one Checkpointer; return each step's
    canonical state."""
    from ftkit import Checkpointer, Config
    ckpt = Checkpointer(topo, Config.load(async_=False, **overrides))
    out = {}
    for s in steps:
        state = small_state(RANK, s)
        out[s] = canon(state)
        ckpt.save(s, state)
    ckpt.close()
    return out


def flushed_step(env: Any, topo: Topology, step: int, **config: Any
                 ) -> tuple[Path, str, list[str]]:
    """Save :func:`small_state` of ``step`` with ``levels=local:1,pfs:1`` (and ``config``),
    close; (the step's PFS directory, the file this rank's group was read from, the files
    COMMITTED lists). All ranks call."""
    from ftkit.storage.pfs.h5read import StepReader
    ckpt = ftkit.Checkpointer(topo, ftkit.Config.load(levels="local:1,pfs:1", **config))
    ckpt.save(step, small_state(RANK, step))
    ckpt.close()
    step_dir = env.pfs_dir / env.job / f"step-{step}"
    WORLD.Barrier()
    with StepReader(step_dir, step, require_commit=True) as reader:
        group, _ = reader.read(RANK)
        files = sorted(reader.digests or {})
    return step_dir, group.file, files


def assert_restores_from_pfs(env: Any, topo: Topology, step: int) -> None:
    """Every node's local directory is removed, then :func:`assert_restores` of ``step``
    (from the PFS). All ranks call."""
    import shutil
    WORLD.Barrier()
    if topo.is_node_leader:
        shutil.rmtree(env.node_dir(topo.node))
    WORLD.Barrier()
    assert_restores(topo, step, "local:1,pfs:1")
