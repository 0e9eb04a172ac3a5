"""Shared helpers of the unit tests (plain pytest, no MPI)."""
from __future__ import annotations

import os
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


@pytest.fixture
def launch_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A clean ftkit environment for ``ftkit run``: no FTKIT_*/fake-mpiexec/Slurm variables
    of the caller, PFS and local dirs under tmp_path (the working directory); the job dir."""
    for key in list(os.environ):
        if key.startswith(("FTKIT_", "FAKE_MPIEXEC_")) or key == "SLURM_JOB_ID":
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FTKIT_PFS_DIR", str(tmp_path / "pfs"))
    monkeypatch.setenv("FTKIT_LOCAL_DIR", str(tmp_path / "local"))
    monkeypatch.setenv("FTKIT_JOB", "t")
    return tmp_path / "pfs" / "t"
