"""ftkit.storage.pfs.early: a rank's PFS file written from its reserved slot while the
capture fills it — the same file the flush would write from the committed shard, nothing
before a tensor landed, no corrupt byte, no temp left when it is given up."""
from __future__ import annotations

import concurrent.futures as cf
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ftkit.capture.flatten import flatten
from ftkit.errors import CorruptCheckpointError, InjectedFault
from ftkit.faults import Faults
from ftkit.storage.local import LocalLevel
from ftkit.storage.pfs import early, hdf5
from ftkit.storage.shard import Shard
from ftkit.storage.slots import NotLanding, Reservation

TOPO = {"dp_idx": 0, "tp_idx": 0, "pp_idx": 0, "node": 0}


def _faults(spec: str = "") -> Faults:
    return Faults(spec, rank=0, node=0, attempt=0)


@pytest.fixture
def pool() -> Iterator[cf.ThreadPoolExecutor]:
    with cf.ThreadPoolExecutor(1) as p:
        yield p


def _state(step: int) -> dict[str, Any]:
    big = torch.arange(3 << 20, dtype=torch.float32) * step          # > RAW_MIN: raw place
    return {"w": big, "b": np.full(7, step, np.int16), "m": torch.ones(3, 4) * step,
            "e": torch.empty(0), "step": step}


def _reserve(tmp_path: Path, step: int) -> tuple[LocalLevel, Reservation, list[Any], Any]:
    level = LocalLevel(tmp_path / "local" / "node-0", rank=0, node_leader=True,
                       faults=_faults())
    level.prepare()
    tree, leaves = flatten(_state(step))
    meta = {"job": "unit", "step": step, "rank": 0, "world": 1}
    res = level.reserve(step, meta, tree, leaves)
    assert res is not None
    return level, res, leaves, tree


def _land_all(res: Reservation, leaves: list[Any]) -> list[np.ndarray]:
    bufs = []
    for i, leaf in enumerate(leaves):
        src = leaf.source.contiguous().view(torch.uint8).numpy().reshape(-1) \
            if isinstance(leaf.source, torch.Tensor) else \
            np.ascontiguousarray(leaf.source).view(np.uint8).reshape(-1)
        res.copy_in(i, src)
        bufs.append(res.view(i))
    return bufs


def _contents(path: Path) -> dict[str, Any]:
    """Every dataset's bytes and attributes, and every group's attributes, by name."""
    import h5py
    out: dict[str, Any] = {}
    with h5py.File(path, "r") as h5:
        def visit(name: str, obj: Any) -> None:
            attrs = {k: np.asarray(v).tolist() for k, v in obj.attrs.items()}
            data = obj[()].tobytes() if isinstance(obj, h5py.Dataset) else None
            out[name] = (data, attrs)
        h5.visititems(visit)
        out["/"] = (None, {k: np.asarray(v).tolist() for k, v in h5.attrs.items()})
    return out


def _temps(staging: Path) -> list[str]:
    return sorted(p.name for p in staging.iterdir()) if staging.is_dir() else []


def _start(tmp_path: Path, res: Reservation, pool: cf.ThreadPoolExecutor,
           faults: Faults | None = None, step: int = 3) -> tuple[early.EarlyWrite, Path]:
    staging = early.staging_dir(tmp_path / "pfs")
    return early.EarlyWrite(step, res, staging, 0, TOPO, pool, faults or _faults(), 30.0), \
        staging


def test_the_early_file_is_the_flushed_file(tmp_path: Path, pool: cf.ThreadPoolExecutor
                                            ) -> None:
    level, res, leaves, tree = _reserve(tmp_path, 3)
    write, staging = _start(tmp_path, res, pool)         # before any tensor landed
    bufs = _land_all(res, leaves)
    level.write_tentative(3, res.meta, tree, leaves, bufs)
    target = tmp_path / "pfs" / "step-3" / "rank-0.h5"
    target.parent.mkdir()
    digest = write.adopt(target)
    assert _temps(staging) == []                        # renamed away, nothing left
    with Shard.open(level.shard_path(3), rank=0, step=3) as shard:
        shard.verify()
        plain = tmp_path / "plain.h5"
        want = hdf5.write_rank_file(plain, shard, TOPO)
    assert _contents(target) == _contents(plain)
    assert len(_contents(plain)) > 5
    assert digest["size"] == want["size"] and digest["raw"] == want["raw"]


def test_nothing_is_written_before_a_tensor_landed_and_a_dropped_one_leaves_no_temp(
        tmp_path: Path, pool: cf.ThreadPoolExecutor) -> None:
    _, res, _, _ = _reserve(tmp_path, 3)
    write, staging = _start(tmp_path, res, pool)
    future = write._future
    with pytest.raises(cf.TimeoutError):
        future.result(timeout=0.3)                      # waits for tensor 0: nothing landed
    write.discard(wait=30)                              # the snapshot is given up
    assert isinstance(future.exception(), NotLanding)
    assert _temps(staging) == []


def test_a_written_early_file_given_up_is_removed(tmp_path: Path,
                                                   pool: cf.ThreadPoolExecutor) -> None:
    _, res, leaves, _ = _reserve(tmp_path, 3)
    write, staging = _start(tmp_path, res, pool)
    _land_all(res, leaves)
    assert write._future.result(timeout=30)[0].parent == staging
    write.discard()                                     # the vote aborted the step
    assert _temps(staging) == []


def test_bytes_that_changed_after_landing_never_reach_the_pfs(
        tmp_path: Path, pool: cf.ThreadPoolExecutor) -> None:
    _, res, leaves, _ = _reserve(tmp_path, 3)
    _land_all(res, leaves)
    res.view(0)[12345] ^= 0xFF                           # after its checksum was taken
    write, staging = _start(tmp_path, res, pool)
    with pytest.raises(CorruptCheckpointError, match="does not match its checksum"):
        write.adopt(tmp_path / "pfs" / "rank-0.h5")
    assert _temps(staging) == [] and not (tmp_path / "pfs" / "rank-0.h5").exists()


def test_the_flush_early_fault_fires_at_the_second_tensor(
        tmp_path: Path, pool: cf.ThreadPoolExecutor) -> None:
    _, res, leaves, _ = _reserve(tmp_path, 3)
    write, staging = _start(tmp_path, res, pool, _faults("raise:step=3:phase=flush-early"))
    res.copy_in(0, leaves[0].source.numpy().view(np.uint8).reshape(-1))
    with pytest.raises(InjectedFault):
        write.adopt(tmp_path / "pfs" / "rank-0.h5")
    assert _temps(staging) == []


def test_every_stale_early_temp_goes_and_nothing_else(tmp_path: Path) -> None:
    """What a Checkpointer's start (rank 0) removes: every rank's early temp, of any world
    size; an entry of another name stays."""
    staging = early.staging_dir(tmp_path / "pfs")
    names = [".rank-0.h5.a1.tmp", ".rank-1.h5.b2.tmp", ".rank-5.h5.c3.tmp", "other",
             ".rank-x.h5.d4.tmp"]
    for name in names:
        (staging / name).write_bytes(b"x")
    early.remove_stale(staging)
    assert _temps(staging) == sorted(["other", ".rank-x.h5.d4.tmp"])


def test_a_staging_name_that_is_no_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "pfs").mkdir()
    os.symlink(tmp_path, tmp_path / "pfs" / early.STAGING)
    with pytest.raises(OSError, match="not a directory"):
        early.staging_dir(tmp_path / "pfs")


def test_an_early_write_whose_slot_was_not_completed_leaves_the_file_to_the_flush(
        tmp_path: Path, pool: cf.ThreadPoolExecutor) -> None:
    """The local write took another way than the reserved slot (it drops the reservation):
    the flush does not fail; it writes the file from the shard (``_adopt`` says None)."""
    from types import SimpleNamespace

    from ftkit.storage.pfs.level import PfsLevel
    _, res, _, _ = _reserve(tmp_path, 3)
    write, staging = _start(tmp_path, res, pool)
    res.drop()
    level = PfsLevel.__new__(PfsLevel)
    level.topo, level.adopted = SimpleNamespace(rank=0), []     # type: ignore[assignment]
    target = tmp_path / "pfs" / "rank-0.h5"
    assert level._adopt(write, target, 3) is None
    assert level.adopted == [] and not target.exists() and _temps(staging) == []
    assert level._adopt(None, target, 3) is None
