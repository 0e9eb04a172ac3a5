"""Shared helpers of the unit tests (plain pytest, no MPI)."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ftkit.capture.flatten import flatten, leaf_from_bytes, unflatten
from ftkit.capture.staging import Stager
from ftkit.storage.shard import Shard, leaves_of, write_shard

META = {"job": "unit", "step": 1, "rank": 0, "world": 1}


def shard_roundtrip(state: Any, directory: Path, name: str = "rank-0.ftk") -> Any:
    """flatten -> Stager.capture -> write_shard -> Shard.open/verify -> unflatten."""
    tree, leaves = flatten(state)
    buffers = Stager().capture(leaves)
    path = directory / name
    write_shard(path, META, tree, leaves, buffers)
    with Shard.open(path, rank=0, step=1) as shard:
        shard.verify()
        tensors = [leaf_from_bytes(leaf, shard.raw(i).copy())
                   for i, leaf in enumerate(leaves_of(shard.header))]
        return unflatten(shard.header["tree"], tensors)


@pytest.fixture
def roundtrip(tmp_path: Path) -> Callable[[Any], Any]:
    """``roundtrip(state)`` writes ``state`` to a shard under tmp_path and reads it back."""
    return lambda state: shard_roundtrip(state, tmp_path)
