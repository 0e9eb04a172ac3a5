"""Large tensors' bytes reach the PFS file with ``O_DIRECT`` straight from the mapped shard,
and fall back to ordinary writes wherever that cannot work: unaligned memory (shards laid
out before large tensors were page-aligned), a file system that refuses direct writes
(``EINVAL``). Any other error of a direct write is the writer's error, as for ordinary ones."""
from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from ftkit.capture.flatten import flatten
from ftkit.capture.staging import Stager
from ftkit.storage import shard as shard_mod
from ftkit.storage.pfs import hdf5
from ftkit.storage.pfs.h5sink import DIRECT_ALIGN, H5Sink
from ftkit.storage.shard import Shard, write_shard

STATE = {"big": np.arange(9 << 18, dtype=np.float32),                  # 9 MiB: 3 pieces
         "odd": np.arange((1 << 18) + 25, dtype=np.float32),           # not whole blocks
         "small": np.arange(100, dtype=np.int64)}


def _direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[bool, int, int]]]:
    """Every ``pwrite`` as (through an O_DIRECT descriptor, offset, length)."""
    seen: list[tuple[bool, int, int]] = []
    real = os.pwrite

    def spy(fd: int, data: Any, offset: int) -> int:
        n = real(fd, data, offset)
        seen.append((_direct(fd), offset, n))
        return n
    monkeypatch.setattr(os, "pwrite", spy)
    yield seen


def _shard(path: Path) -> Path:
    tree, leaves = flatten(STATE)
    write_shard(path, {"job": "j", "step": 3, "rank": 0, "world": 1}, tree, leaves,
                Stager().capture(leaves))
    return path


def _write(tmp_path: Path, shard_path: Path) -> Path:
    out = tmp_path / "rank-0.h5"
    with Shard.open(shard_path, rank=0, step=3) as shard:
        hdf5.write_rank_file(out, shard, {})
    return out


def _check(path: Path) -> dict[str, int]:
    """The file reads back with plain h5py; offset of every large dataset."""
    offsets = {}
    with h5py.File(path, "r") as h5:
        for ds in h5["rank/0"].values():
            name = ds.attrs["ftkit_path"]
            assert np.array_equal(ds[()].reshape(-1), STATE[name]), name
            if STATE[name].nbytes >= hdf5.RAW_MIN:
                offsets[name] = int(ds.id.get_offset())
    return offsets


def _require_direct(d: Path) -> None:
    try:
        os.close(os.open(d / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError as exc:
        pytest.skip(f"{d}: no O_DIRECT here ({exc})")
    (d / "probe").unlink()


def test_large_tensors_go_direct_in_whole_aligned_blocks(
        tmp_path: Path, writes: list[tuple[bool, int, int]]) -> None:
    _require_direct(tmp_path)
    offsets = _check(_write(tmp_path, _shard(tmp_path / "s.ftk")))
    direct = [(off, n) for d, off, n in writes if d]
    assert all(off % DIRECT_ALIGN == 0 and n % DIRECT_ALIGN == 0 for off, n in direct)
    for name, start in offsets.items():
        assert start % DIRECT_ALIGN == 0, name            # datasets aligned in the file
        body = STATE[name].nbytes // DIRECT_ALIGN * DIRECT_ALIGN
        assert sum(n for off, n in direct if start <= off < start + body) == body, name
    tail = STATE["odd"].nbytes % DIRECT_ALIGN                 # the tail: ordinary write
    assert (False, offsets["odd"] + STATE["odd"].nbytes - tail, tail) in writes


def test_unaligned_shard_memory_is_written_the_ordinary_way(
        tmp_path: Path, writes: list[tuple[bool, int, int]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard laid out with 64-byte alignment only (as before large tensors started at a
    page) is still flushed, all of it through the ordinary descriptor."""
    monkeypatch.setattr(shard_mod, "PAGE_MIN", 1 << 62)
    path = _shard(tmp_path / "s.ftk")
    with Shard.open(path, rank=0, step=3) as shard:
        assert any(t["offset"] % DIRECT_ALIGN for t in shard.tensors)
    writes.clear()
    _check(_write(tmp_path, path))
    assert writes and not any(d for d, _, _ in writes)


def _sink(tmp_path: Path) -> tuple[H5Sink, Path]:
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    return H5Sink(fd, os.open(path, os.O_WRONLY)), path      # a stand-in "direct" fd


def _failing_direct(monkeypatch: pytest.MonkeyPatch, sink: H5Sink, code: int) -> None:
    real, direct_fd = os.pwrite, sink.direct_fd

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if fd == direct_fd:
            raise OSError(code, os.strerror(code))
        return real(fd, data, offset)
    monkeypatch.setattr(os, "pwrite", pwrite)


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + DIRECT_ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % DIRECT_ALIGN
    buf = raw[skip:skip + nbytes]
    buf[:] = np.arange(nbytes) % 251
    return buf


def test_einval_from_a_direct_write_falls_back_for_good(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sink, path = _sink(tmp_path)
    _failing_direct(monkeypatch, sink, errno.EINVAL)
    buf = _aligned(3 * DIRECT_ALIGN + 7)
    assert sink.write_bulk(buf, DIRECT_ALIGN) == buf.nbytes
    assert sink.direct_fd is None and sink.error is None
    assert sink.write_bulk(buf, 8 * DIRECT_ALIGN) == buf.nbytes
    data = path.read_bytes()
    assert data[DIRECT_ALIGN:DIRECT_ALIGN + buf.nbytes] == buf.tobytes()
    assert data[8 * DIRECT_ALIGN:] == buf.tobytes()
    os.close(sink.fd)


def test_other_errors_of_a_direct_write_are_the_writers_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sink, _ = _sink(tmp_path)
    _failing_direct(monkeypatch, sink, errno.EIO)
    with pytest.raises(OSError) as err:
        sink.write_bulk(_aligned(2 * DIRECT_ALIGN), 0)
    assert err.value.errno == errno.EIO and sink.error is err.value
    with pytest.raises(OSError) as again:                # every later write fails the same
        sink.write_at(b"x", 0)
    assert again.value is err.value
    sink.discard()                                       # ... until the file is abandoned
    assert sink.write_bulk(_aligned(DIRECT_ALIGN), 0) == DIRECT_ALIGN
    sink.close()
    os.close(sink.fd)
