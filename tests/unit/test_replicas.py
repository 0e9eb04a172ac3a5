"""The replicas' comparison decides alike for every replica (a stand-in for the DP group's
allgather): alike tensors are replicated, a tensor on a GPU stays whole without its bytes
being read, rank-local and differing ones stay whole."""
from __future__ import annotations

import types
from typing import Any

import numpy as np
import torch

import ftkit
from ftkit.capture.flatten import flatten
from ftkit.storage import replicas
from ftkit.storage.replicas import classify


class _Group:
    """Replicas whose tensors' fingerprints are this rank's, but for ``others``."""

    def __init__(self, size: int, others: dict[int, Any] | None = None) -> None:
        self.rank, self.size, self.others = 0, size, others or {}

    def allgather(self, obj: Any, phase: str, step: int | None = None) -> list[Any]:
        return [{**obj, "rank": r} if r not in self.others else self.others[r](obj)
                for r in range(self.size)]


class _OnGpu:
    """A tensor whose device is a GPU: reading its bytes would fail the test."""

    device = types.SimpleNamespace(type="cuda")

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the bytes of a GPU tensor were read ({name})")


def test_alike_tensors_are_replicated_and_a_gpu_one_stays_whole():
    tree, leaves = flatten({"w": torch.ones(4), "g": torch.zeros(2), "np": np.arange(3),
                            "rng": ftkit.RNGState()})
    gpu = next(i for i, leaf in enumerate(leaves) if leaf.path == "g")
    leaves[gpu].source = _OnGpu()
    got = classify(_Group(4), 0, tree, leaves)        # type: ignore[arg-type]
    paths = {leaves[i].path for i in got.replicated}
    assert paths == {"w", "np"}
    assert got.whole[gpu].startswith("on a GPU")
    assert all(why == "rank-local" for i, why in got.whole.items() if i != gpu)


def test_a_tensor_one_replica_holds_otherwise_stays_whole():
    tree, leaves = flatten({"w": torch.ones(4), "b": torch.zeros(2)})

    def other_w(obj: Any) -> Any:
        out = {"rank": 3, "leaves": [list(p) for p in obj["leaves"]]}
        out["leaves"][0][-1] = "xxh3-64:" + "f" * 16
        return out
    got = classify(_Group(4, {3: other_w}), 0, tree, leaves)   # type: ignore[arg-type]
    assert [leaves[i].path for i in got.replicated] == ["b"]
    assert "ranks [3]: w float32 [4] xxh3-64:ffffffffffffffff" in got.whole[0]
    assert "ranks [0, 1, 2]: w float32 [4] xxh3-64:" in got.whole[0]
    assert replicas.ON_DEVICE not in got.whole[0]
