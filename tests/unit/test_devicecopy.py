"""Restoring through a reused host buffer (ftkit.capture.devicecopy, Shard.read_through) and
where each restored tensor lands (ftkit.capture.inplace.destination).

The piecewise path is what a GPU restore runs; on the CPU it copies synchronously, which is
how its pieces, offsets, checksum and pass counts are tested here. The CUDA tests run only
where a GPU is present."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ftkit import passes
from ftkit.capture.devicecopy import DeviceLanding, device_target
from ftkit.capture.flatten import flatten
from ftkit.capture.inplace import destination, live_leaves
from ftkit.capture.staging import Stager
from ftkit.recovery import restore
from ftkit.storage.shard import Shard, write_shard

META = {"job": "unit", "step": 3, "rank": 0, "world": 1}
N = 1_000_003                          # not a multiple of the piece or of the read chunk
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _saved(tmp_path: Path, state: dict[str, Any]) -> Path:
    tree, leaves = flatten(state)
    path = tmp_path / "rank-0.ftk"
    write_shard(path, META, tree, leaves, Stager().capture(leaves))
    return path


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    return {"w": torch.randint(0, 256, (N,), dtype=torch.uint8, generator=gen),
            "b": torch.randn(7, 3, generator=gen)}


def test_read_through_lands_every_piece_at_its_offset(tmp_path: Path) -> None:
    state = _state()
    landing, target = DeviceLanding(piece=65_539), torch.zeros(N, dtype=torch.uint8)
    with Shard.open(_saved(tmp_path, state), rank=0, step=3) as shard:
        before = passes.snapshot()
        landing.start(target)
        assert shard.read_through(0, landing)
        landing.finish()
        moved = passes.since(before)
    assert torch.equal(target, state["w"])
    assert moved["copy"] == 2 * N          # the read (hash riding on it) + the copy out


def test_read_through_reports_a_damaged_byte(tmp_path: Path) -> None:
    path = _saved(tmp_path, _state())
    with Shard.open(path, rank=0, step=3) as shard:
        at = shard.tensors[0]["offset"] + N - 2       # in the last, short piece
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
    landing = DeviceLanding(piece=4096)
    with Shard.open(path, rank=0, step=3) as shard:
        landing.start(torch.zeros(N, dtype=torch.uint8))
        assert not shard.read_through(0, landing)
        into = np.zeros(N, dtype=np.uint8)
        assert not shard.read_into(0, into)           # the one-buffer path agrees
    landing.finish()


def test_cpu_tensors_land_in_place_and_strangers_in_new_buffers() -> None:
    state = _state()
    live = live_leaves(state)
    saved = live_leaves(_state())
    dest, value = destination(saved[0], live[0])
    assert value is state["w"] and isinstance(dest, np.ndarray)
    assert np.shares_memory(dest, state["w"].numpy())
    dest, value = destination(saved[0], live[1])                 # another tensor's place
    assert value is None and isinstance(dest, np.ndarray) and dest.nbytes == N
    assert device_target(state["w"]) is None                     # CPU: not a device target


@cuda
def test_cuda_tensors_are_read_through_the_pinned_buffer(tmp_path: Path) -> None:
    saved = _state()
    path = _saved(tmp_path, saved)
    live = {k: torch.zeros_like(v, device="cuda") for k, v in saved.items()}
    with Shard.open(path, rank=0, step=3) as shard:
        reading = restore._plan_reading(shard, 0, 3, live)
        assert all(isinstance(d, torch.Tensor) and d.is_cuda for d in reading.dests)
        restore._read_checked(shard, reading, 0, 3)
    for key, tensor in saved.items():
        assert reading.tree[key] is live[key]
        assert torch.equal(live[key].cpu(), tensor)


@cuda
def test_a_cuda_landing_reuses_one_pinned_buffer() -> None:
    landing = DeviceLanding(piece=1 << 20)
    src = np.arange(5 << 20, dtype=np.uint64).view(np.uint8)[: (5 << 20) + 3]
    target = torch.zeros(len(src), dtype=torch.uint8, device="cuda")
    landing.start(target)
    buffers = set()
    for at in range(0, len(src), landing.piece):
        piece = landing.buffer(min(landing.piece, len(src) - at))
        piece[:] = src[at:at + len(piece)]
        buffers.add(piece.__array_interface__["data"][0])
        landing.land(at, piece)
    landing.finish()
    assert len(buffers) == 2 and landing._host[0].is_pinned()
    assert torch.equal(target.cpu(), torch.from_numpy(src.copy()))
