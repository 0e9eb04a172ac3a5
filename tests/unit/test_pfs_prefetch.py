"""The prefetch of a checked rank file's tensor bytes while a restore parses its metadata
(ftkit/storage/pfs/prefetch.py): what it reads, that it stops, that it changes nothing."""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ftkit.errors import CorruptCheckpointError
from ftkit.storage.pfs import h5read, prefetch
from ftkit.storage.pfs.h5read import StepReader
from ftkit.storage.pfs.prefetch import Prefetch
from tests.unit.test_hdf5_meta import _state, write_step

WAIT = 30.0


def _recorded(monkeypatch: pytest.MonkeyPatch) -> list[Prefetch]:
    """Every prefetch the readers start from now on, in order."""
    started: list[Prefetch] = []

    class Recorded(Prefetch):
        def __init__(self, path: Path, ranges: list[list[int]]) -> None:
            super().__init__(path, ranges)
            started.append(self)
    monkeypatch.setattr(h5read, "Prefetch", Recorded)
    return started


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
    started = _recorded(monkeypatch)
    with StepReader(step_dir, 1, require_commit=True, prefetch=1) as reader:
        # started once COMMITTED was read and the file checked, before the index is opened
        assert [p.path for p in started] == [step_dir / "rank-1.h5"]
        assert reader.prefetch is started[0]
        group = reader.group(1)
        assert len(started) == 1 and not started[0]._stopped.is_set()
        _, arrays = reader.read(1)
        assert started[0]._stopped.is_set()
        assert started[0].done.wait(WAIT)
    assert group.attrs["rank"] == 1
    want = states[1]["model"]
    got = {e["path"]: a for e, a in zip(group.entries, arrays)}
    for name, value in want.items():
        assert np.array_equal(got[f"model/{name}"].view(value.dtype).reshape(value.shape),
                              value)


def test_no_prefetch_of_a_file_its_digest_does_not_check(tmp_path: Path) -> None:
    """Without COMMITTED there are no trusted ranges to read ahead; a rank file that does
    not match its digest is not read ahead either, and opening its group says why."""
    step_dir = tmp_path / "job" / "step-1"
    write_step(step_dir, [_state(0), _state(1)], rank_files=True)
    with StepReader(step_dir, 1, require_commit=True, prefetch=0) as reader:
        assert reader.prefetch is not None
    with open(step_dir / "rank-0.h5", "ab") as fh:
        fh.write(b"x")
    with StepReader(step_dir, 1, require_commit=True, prefetch=0) as reader:
        assert reader.prefetch is None
        with pytest.raises(CorruptCheckpointError, match="rank-0.h5"):
            reader.group(0)
    (step_dir / "COMMITTED").unlink()
    with StepReader(step_dir, 1, prefetch=1) as reader:
        reader.group(1)
        assert reader.prefetch is None


def test_only_a_reader_asked_to_prefetch_does(tmp_path: Path) -> None:
    """``ftkit inspect`` reads metadata only: its reader reads no tensor bytes ahead; a
    restore reads ahead only its own rank's file (each rank another file)."""
    step_dir = tmp_path / "job" / "step-1"
    write_step(step_dir, [_state(0), _state(1)], rank_files=True)
    with StepReader(step_dir, 1, require_commit=True) as reader:
        reader.group(0)
        assert reader.prefetch is None
    with StepReader(step_dir, 1, require_commit=True, prefetch=1) as reader:
        assert reader.prefetch is not None and reader.prefetch.path.name == "rank-1.h5"


def test_close_or_a_failed_open_stops_the_prefetch(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    step_dir = tmp_path / "job" / "step-1"
    write_step(step_dir, [_state(0), _state(1)], rank_files=True)
    reader = StepReader(step_dir, 1, require_commit=True, prefetch=0)
    reader.group(0)
    assert reader.prefetch is not None
    reader.close()
    assert reader.prefetch._stopped.is_set() and reader.prefetch.done.wait(WAIT)
    started = _recorded(monkeypatch)
    with pytest.raises(CorruptCheckpointError, match="another"):
        StepReader(step_dir, 1, require_commit=True, prefetch=0, job="another")
    assert len(started) == 1 and started[0]._stopped.is_set()
