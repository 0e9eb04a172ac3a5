"""The prefetch of a checked rank file's tensor bytes while a restore parses its metadata
(ftkit/storage/pfs/prefetch.py): what it reads, that it stops, that it changes nothing."""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ftkit.storage.pfs import h5read, prefetch
from ftkit.storage.pfs.h5read import StepReader
from ftkit.storage.pfs.prefetch import Prefetch
from tests.unit.test_hdf5_meta import _state, write_step

WAIT = 30.0


def _file(tmp_path: Path, size: int) -> Path:
    path = tmp_path / "rank-0.h5"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8))
    return path


def test_it_reads_exactly_the_ranges_given(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = _file(tmp_path, 6 << 20)
    monkeypatch.setattr(prefetch, "PIECE", 1 << 20)
    seen: list[tuple[int, int]] = []
    real = os.preadv

    def preadv(fd: int, bufs: list[Any], at: int) -> int:
        seen.append((at, len(bufs[0])))
        return real(fd, bufs, at)
    monkeypatch.setattr(prefetch.os, "preadv", preadv)
    ranges = [[4096, (1 << 20) + 10], [5 << 20, 100]]
    p = Prefetch(path, ranges)
    assert p.done.wait(WAIT)
    assert seen == [(4096, 1 << 20), (4096 + (1 << 20), 10), (5 << 20, 100)]
    assert p.read == (1 << 20) + 110


def test_no_read_starts_after_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _file(tmp_path, 4 << 20)
    monkeypatch.setattr(prefetch, "PIECE", 1 << 20)
    inside, release = threading.Event(), threading.Event()
    calls: list[int] = []
    real = os.preadv

    def preadv(fd: int, bufs: list[Any], at: int) -> int:
        calls.append(at)
        inside.set()
        release.wait(WAIT)
        return real(fd, bufs, at)
    monkeypatch.setattr(prefetch.os, "preadv", preadv)
    p = Prefetch(path, [[0, 4 << 20]])
    assert inside.wait(WAIT)
    p.stop()                         # while the first read is under way
    release.set()
    assert p.done.wait(WAIT)
    assert calls == [0] and p.read == 1 << 20


def test_an_unreadable_file_ends_it_quietly(tmp_path: Path) -> None:
    p = Prefetch(tmp_path / "gone.h5", [[0, 100]])
    assert p.done.wait(WAIT) and p.read == 0
    link = tmp_path / "link.h5"
    link.symlink_to(_file(tmp_path, 8192))
    p = Prefetch(link, [[0, 100]])            # never through a symbolic link
    assert p.done.wait(WAIT) and p.read == 0
    short = _file(tmp_path, 100)
    p = Prefetch(short, [[0, 100], [4096, 100]])     # the file ends before the ranges
    assert p.done.wait(WAIT) and p.read == 100


def test_a_restore_prefetches_its_rank_file_until_it_reads_the_tensors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step_dir = tmp_path / "job" / "step-1"
    states = [_state(0), _state(1)]
    write_step(step_dir, states, rank_files=True)
    started: list[Prefetch] = []

    class Recorded(Prefetch):
        def __init__(self, path: Path, ranges: list[list[int]]) -> None:
            super().__init__(path, ranges)
            started.append(self)
    monkeypatch.setattr(h5read, "Prefetch", Recorded)
    with StepReader(step_dir, 1, require_commit=True) as reader:
        assert reader.prefetch is None                  # the index: no tensor bytes
        group = reader.group(1)
        assert [p.path for p in started] == [step_dir / "rank-1.h5"]
        assert reader.prefetch is started[0] and not started[0]._stopped.is_set()
        _, arrays = reader.read(1)
        assert started[0]._stopped.is_set()
        assert started[0].done.wait(WAIT)
    assert group.attrs["rank"] == 1
    want = states[1]["model"]
    got = {e["path"]: a for e, a in zip(group.entries, arrays)}
    for name, value in want.items():
        assert np.array_equal(got[f"model/{name}"].view(value.dtype).reshape(value.shape),
                              value)


def test_no_prefetch_without_the_digests_that_check_the_file(tmp_path: Path) -> None:
    """A file not checked against COMMITTED first has no trusted ranges to read ahead."""
    step_dir = tmp_path / "job" / "step-1"
    write_step(step_dir, [_state(0), _state(1)], rank_files=True)
    (step_dir / "COMMITTED").unlink()
    with StepReader(step_dir, 1) as reader:
        reader.group(0)
        assert reader.prefetch is None


def test_close_stops_a_prefetch_never_followed_by_a_read(tmp_path: Path) -> None:
    step_dir = tmp_path / "job" / "step-1"
    write_step(step_dir, [_state(0), _state(1)], rank_files=True)
    reader = StepReader(step_dir, 1, require_commit=True)
    reader.group(0)
    assert reader.prefetch is not None
    reader.close()
    assert reader.prefetch._stopped.is_set() and reader.prefetch.done.wait(WAIT)
