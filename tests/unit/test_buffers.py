"""Host buffers the kernel fills at full speed (ftkit.buffers), and reads through an
aligned bounce into misaligned memory (Shard.read_into)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from ftkit import buffers
from ftkit.buffers import BOUNCE, FAST_ALIGN, PAGE, aligned_empty, aligned_zeros, misaligned
from ftkit.capture.flatten import flatten
from ftkit.capture.staging import Stager
from ftkit.storage.shard import Shard, write_shard


@pytest.mark.parametrize("nbytes", [0, 1, 63, PAGE, PAGE + 1, 5 << 20])
def test_aligned_buffers_start_on_a_page(nbytes: int) -> None:
    for buf in (aligned_empty(nbytes), aligned_zeros(nbytes)):
        assert buf.dtype == np.uint8 and buf.shape == (nbytes,)
        assert buf.ctypes.data % PAGE == 0 or not nbytes   # an empty one has no bytes
        assert buf.flags.writeable and buf.flags.c_contiguous
    assert not aligned_zeros(nbytes).any()


def test_misaligned_is_relative_to_fast_align() -> None:
    buf = aligned_empty(4 * FAST_ALIGN)
    assert not misaligned(buf)
    assert not misaligned(buf[FAST_ALIGN:])
    assert misaligned(buf[16:])
    assert misaligned(buf[1:])


def _shard(tmp_path: Path, data: np.ndarray) -> Path:
    tree, leaves = flatten({"x": data})
    path = tmp_path / "rank-0.ftk"
    write_shard(path, {"job": "unit", "step": 1, "rank": 0, "world": 1}, tree, leaves,
                Stager().capture(leaves))
    return path


@pytest.mark.parametrize("offset", [0, 16, 1])
def test_read_into_misaligned_memory_lands_every_byte(tmp_path: Path, offset: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel only ever fills aligned memory; several bounce pieces and a short tail
    land where they belong, and the checksum is the one of the bytes that landed (a flipped
    byte in the file is caught)."""
    monkeypatch.setattr("ftkit.storage.shard.BOUNCE", 3 * PAGE)
    filled: list[int] = []
    preadv = os.preadv

    def spy(fd: int, bufs: list[memoryview], pos: int) -> int:
        filled.extend(np.frombuffer(b, np.uint8).ctypes.data % FAST_ALIGN for b in bufs)
        return preadv(fd, bufs, pos)
    monkeypatch.setattr(os, "preadv", spy)
    assert BOUNCE == buffers.BOUNCE
    data = np.random.default_rng(3).integers(0, 256, 10 * PAGE + 123, dtype=np.uint8)
    path = _shard(tmp_path, data)
    room = aligned_zeros(data.nbytes + offset)
    dest = room[offset:]
    assert misaligned(dest) == bool(offset)
    with Shard.open(path) as shard:
        assert shard.read_into(0, dest)
        start = shard.tensors[0]["offset"]
    assert np.array_equal(dest, data) and not room[:offset].any()
    assert filled and set(filled) == {0}
    raw = bytearray(path.read_bytes())
    raw[start + 7 * PAGE + 5] ^= 0x40                  # inside the third bounce piece
    path.write_bytes(bytes(raw))
    with Shard.open(path) as shard:
        assert not shard.read_into(0, dest)
