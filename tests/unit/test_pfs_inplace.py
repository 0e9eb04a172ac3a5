"""Restore from the PFS level reads every tensor straight into its live counterpart, piece by
piece (``ftkit.storage.pfs.h5data``, ``ftkit.capture.landing``): no second copy of the state,
a damaged step is read over by an older one, and a read that was given up never writes into
the live state afterwards."""
from __future__ import annotations

import os
import threading
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import h5py
import numpy as np
import pytest

from ftkit import passes
from ftkit.capture.flatten import flatten
from ftkit.capture.landing import Abandoned, Gate, GatedLanding
from ftkit.capture.staging import Stager
from ftkit.errors import CorruptCheckpointError
from ftkit.faults import flip_byte
from ftkit.recovery import pfs_restore
from ftkit.storage.pfs import h5data, hdf5
from ftkit.storage.shard import Shard, checksum, write_shard
from tests.unit.test_hdf5_hostile import _craft, _replace_dataset
from tests.unit.test_hdf5_meta import _OneRank, _Pfs, _state, data_file, write_step


def _zeroed(state: dict[str, Any]) -> dict[str, Any]:
    for v in state["model"].values():
        v[...] = 0
    return state


def _restore(job: Path, state: dict[str, Any], timeout: float = 30.0
             ) -> tuple[int, dict[int, str]]:
    pfs = _Pfs(job, 1)
    pfs.config = SimpleNamespace(job="synth", timeout=timeout)
    return pfs_restore.restore_from_pfs(_OneRank(), pfs, state,  # type: ignore[arg-type]
                                        lambda ev, **kw: None)


def test_tensors_land_in_the_live_arrays_through_bounce_buffers(tmp_path: Path) -> None:
    """Before: h5py read each tensor into a new array (the whole state twice in memory).
    Now two 4 MiB bounce buffers at most (one holds the piece read ahead)."""
    big = {"model": {"w": np.random.default_rng(3).integers(0, 2**31, 6 << 20,
                                                              dtype=np.int32)},
           "data": {"pos": 5}}
    write_step(tmp_path / "job" / "step-1", [big], step=1, ranks_per_node=1, rank_files=True)
    live = {"model": {"w": np.zeros_like(big["model"]["w"])}, "data": {"pos": 0}}
    target = live["model"]["w"]
    tracemalloc.start()
    try:
        got, skipped = _restore(tmp_path / "job", live)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (got, skipped) == (1, {})
    assert live["model"]["w"] is target and np.array_equal(target, big["model"]["w"])
    assert live["data"]["pos"] == 5
    assert peak < target.nbytes // 2, f"peak {peak} bytes for a {target.nbytes}-byte tensor"


def test_a_damaged_step_is_read_over_by_the_older_one(tmp_path: Path) -> None:
    """Step 2's last tensor has a flipped data byte (the file digests still hold: only the
    tensor's checksum sees it). Its other tensors were already read into the live arrays;
    step 1 is then read over every one of them: nothing of step 2 remains."""
    job = tmp_path / "job"
    old, new = _state(0, pos=1000), _state(0, pos=2000)
    for v in new["model"].values():
        v += 50
    write_step(job / "step-1", [old], step=1, ranks_per_node=1, rank_files=True)
    write_step(job / "step-2", [new], step=2, ranks_per_node=1, rank_files=True)
    path = data_file(job / "step-2", 0)
    with h5py.File(path, "r") as h5:
        at = h5["rank/0/model/n"].id.get_offset() + 5
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x40]))
    live = _zeroed(_state(0, pos=0))
    got, skipped = _restore(job, live)
    assert got == 1 and "checksum mismatch" in skipped[2] and "model/n" in skipped[2]
    for name, saved in old["model"].items():
        assert np.array_equal(live["model"][name], saved), name
    assert live["data"]["pos"] == 1000


def _reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ftkit-pfs-read"]


def test_a_read_given_up_never_writes_the_live_state_later(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The file system hangs while step 2's second tensor is read; restore gives the read up
    (deadline) and returns. When the stuck thread wakes up later, its bytes are dropped:
    the live state is exactly as restore left it."""
    job = tmp_path / "job"
    write_step(job / "step-2", [_state(0, pos=1234)], step=2, ranks_per_node=1,
               rank_files=True)
    real, calls, release = h5data.read_dataset, [], threading.Event()

    def hangs_on_the_second(fd: Any, ds: Any, nbytes: int, landing: Any) -> str:
        calls.append(ds.name)
        if len(calls) == 2:
            release.wait()
        return real(fd, ds, nbytes, landing)
    monkeypatch.setattr(h5data, "read_dataset", hangs_on_the_second)
    live = _zeroed(_state(0, pos=0))
    before = set(_reader_threads())
    try:
        got, skipped = _restore(job, live, timeout=0.5)
        assert got == 0 and "made no progress" in skipped[2]
        assert np.array_equal(live["model"]["a"], _state(0)["model"]["a"])   # read in place
        after_restore = {k: v.copy() for k, v in live["model"].items()}
    finally:
        release.set()
    for thread in set(_reader_threads()) - before:
        thread.join(timeout=30)
        assert not thread.is_alive()
    assert len(calls) >= 2                    # the stuck thread did go on reading
    for name, value in after_restore.items():
        assert np.array_equal(live["model"][name], value), f"{name} written after restore"


def _land_across_the_close(landing: GatedLanding, dest: Any) -> None:
    """Land 4 bytes of 1, close the gate, try to land 4 bytes of 2 (refused)."""
    landing.start(dest, True)
    piece = landing.buffer(0, 4)
    piece[:] = 1
    landing.land(0, piece)
    landing.gate.close()
    piece = landing.buffer(4, 4)
    piece[:] = 2
    with pytest.raises(Abandoned):
        landing.land(4, piece)
    landing.finish()


def test_gate_closed_drops_pieces_for_live_memory_only() -> None:
    landing = GatedLanding(Gate(), piece=4)
    live, fresh = np.zeros(8, dtype=np.uint8), np.zeros(8, dtype=np.uint8)
    _land_across_the_close(landing, live)
    assert live.tolist() == [1] * 4 + [0] * 4
    landing.start(fresh, False)               # a new buffer nobody else sees: read directly
    piece = landing.buffer(4, 4)
    piece[:] = 3
    landing.land(4, piece)
    assert fresh.tolist() == [0] * 4 + [3] * 4


# ------------------------------------------------------------------ which bytes, from where

def _dataset(tmp_path: Path, data: np.ndarray, **create: Any) -> tuple[Path, str]:
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as h5:
        h5.create_dataset("x", data=data, **create)
    return path, "x"


def _read(path: Path, name: str, nbytes: int, piece: int = 1000
          ) -> tuple[np.ndarray, str, list[Any] | None]:
    out = np.zeros(nbytes, dtype=np.uint8)
    landing = GatedLanding(piece=piece)
    landing.start(out, True)
    fd = h5data.os.open(path, h5data.os.O_RDONLY)
    try:
        with h5py.File(path, "r") as h5:
            where = h5data.spans(h5[name], nbytes)
            got = h5data.read_dataset(fd, h5[name], nbytes, landing)
    finally:
        h5data.os.close(fd)
    return out, got, where


@pytest.mark.parametrize("layout", ["contiguous", "row chunks", "row chunks, ragged end"])
def test_plain_datasets_are_read_from_their_file_offsets(tmp_path: Path, layout: str) -> None:
    rows = {"contiguous": 40, "row chunks": 40, "row chunks, ragged end": 43}[layout]
    data = np.arange(rows * 25, dtype=np.float32).reshape(rows, 25)
    chunks = None if layout == "contiguous" else (8, 25)
    path, name = _dataset(tmp_path, data, chunks=chunks)
    before = passes.snapshot()
    out, got, where = _read(path, name, data.nbytes)
    assert where is not None and len(where) == (1 if chunks is None else -(-rows // 8))
    assert out.tobytes() == data.tobytes() and got == checksum(data)
    assert passes.since(before)["read"] == data.nbytes


@pytest.mark.parametrize("create", [
    {"chunks": (4, 5)},                                     # chunked along two dimensions
    {"compression": "gzip"},                                # filtered (not written by ftkit)
    {"dtype": ">f4"},                                       # not NumPy's layout here
], ids=["2-d chunks", "filtered", "big-endian"])
def test_other_datasets_are_read_through_h5py(tmp_path: Path, create: dict[str, Any]) -> None:
    data = np.arange(200, dtype=np.float32).reshape(20, 10)
    path, name = _dataset(tmp_path, data, **create)
    with h5py.File(path, "r") as h5:
        expected = np.ascontiguousarray(h5[name][()]).reshape(-1).view(np.uint8)
    out, got, where = _read(path, name, data.nbytes, piece=64)
    assert where is None
    assert out.tobytes() == expected.tobytes() and got == checksum(expected)


def _rechunk(h5: Any) -> None:
    """Rewrite every dataset of /rank/0 in chunks of rows (as ftkit wrote tensors above
    64 MiB before their bytes were written at their place)."""
    for name in ("model/a", "model/n"):
        path = f"rank/0/{name}"
        data = h5[path][()]
        _replace_dataset(h5, path, data=data, chunks=(1, 3) if data.ndim == 2 else (3,))


def test_steps_written_in_row_chunks_restore(tmp_path: Path) -> None:
    """Steps of earlier versions hold large tensors in chunks of rows; restore reads them
    piece by piece from every chunk's offset, the last chunk ragged."""
    state = _state(0, pos=77)
    step = tmp_path / "job" / "step-1"
    write_step(step, [state], step=1, ranks_per_node=1, rank_files=True)
    _craft(data_file(step, 0), _rechunk)
    with h5py.File(data_file(step, 0), "r") as h5:
        assert h5["rank/0/model/a"].chunks == (1, 3) and h5["rank/0/model/n"].chunks == (3,)
    live = _zeroed(_state(0, pos=0))
    assert _restore(tmp_path / "job", live) == (1, {})
    for name, saved in state["model"].items():
        assert np.array_equal(live["model"][name], saved), name


def test_large_tensors_are_written_at_their_place(tmp_path: Path) -> None:
    """Tensors from ``RAW_MIN`` bytes on are contiguous datasets allocated at creation and
    never filled by libhdf5; their bytes, written by ftkit at the dataset's offset, read
    back through plain h5py."""
    rng = np.random.default_rng(8)
    state = {"model": {"big": rng.standard_normal((300, 100)).astype(np.float32),
                       "raw": rng.integers(0, 256, hdf5.RAW_MIN, dtype=np.uint8),
                       "small": np.arange(5, dtype=np.int64)}, "data": {"pos": 1}}
    step = tmp_path / "job" / "step-1"
    write_step(step, [state], step=1, ranks_per_node=1, rank_files=True)
    with h5py.File(data_file(step, 0), "r") as h5:
        for name, value in state["model"].items():
            ds = h5[f"rank/0/model/{name}"]
            plist = ds.id.get_create_plist()
            assert plist.get_layout() == h5py.h5d.CONTIGUOUS, name
            early = plist.get_alloc_time() == h5py.h5d.ALLOC_TIME_EARLY
            assert early == (value.nbytes >= hdf5.RAW_MIN), name
            assert np.array_equal(ds[()], value), name
    live = {"model": {k: np.zeros_like(v) for k, v in state["model"].items()},
            "data": {"pos": 0}}
    assert _restore(tmp_path / "job", live) == (1, {})
    for name, value in state["model"].items():
        assert np.array_equal(live["model"][name], value), name


def test_a_corrupt_shard_written_at_its_place_leaves_no_file(tmp_path: Path) -> None:
    """The raw path checks the shard's checksum too: a flipped byte in the last piece of a
    large tensor (three pieces, hashed ahead of their writes) raises and nothing of the file
    remains."""
    state = {"w": np.arange(2 * hdf5.RAW_PIECE // 4 + 7, dtype=np.float32)}
    tree, leaves = flatten(state)
    path = tmp_path / "rank-0.ftk"
    write_shard(path, {"job": "j", "step": 3, "rank": 0, "world": 1}, tree, leaves,
                Stager().capture(leaves))
    with Shard.open(path) as shard:
        offset = shard.tensors[0]["offset"] + shard.tensors[0]["nbytes"] - 3
    flip_byte(path, offset)
    out = tmp_path / "rank-0.h5"
    with Shard.open(path, rank=0, step=3) as shard, \
            pytest.raises(CorruptCheckpointError, match=r"'w' does not match its checksum"):
        hdf5.write_rank_file(out, shard, {})
    assert not out.exists() and not list(tmp_path.glob(".rank-0.h5*"))


def test_device_destinations_pass_the_gate_too() -> None:
    """A GPU tensor's pieces go through the pinned buffer of DeviceLanding; the same code
    copies into a CPU torch tensor, which is how it is tested here: the gate holds for it."""
    torch = pytest.importorskip("torch")
    target = torch.zeros(8, dtype=torch.uint8)
    _land_across_the_close(GatedLanding(Gate(), piece=4), target)
    assert target.tolist() == [1] * 4 + [0] * 4


def test_a_large_datasets_next_piece_is_read_while_this_one_lands(tmp_path: Path) -> None:
    """From AHEAD_MIN pieces on, pieces are read on a helper thread, one ahead, into the
    second bounce buffer; fewer are read on the caller's thread through one buffer; the
    live array gets every byte either way."""
    from ftkit.capture.landing import GatedLanding
    from ftkit.storage.pfs import h5data
    piece = 1 << 16
    data = np.random.default_rng(5).integers(0, 256, 10 * piece, dtype=np.uint8)
    path = tmp_path / "bytes"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        for count, threads, buffers in ((10, {"ftkit-read_0"}, 2),
                                        (h5data.AHEAD_MIN - 1, {"MainThread"}, 1)):
            live, seen = np.zeros_like(data), set()
            landing = GatedLanding(piece=piece)
            landing.start(live, live=True)

            def fill(out: np.ndarray, pos: int, seen: set[str] = seen) -> None:
                seen.add(threading.current_thread().name)
                assert os.preadv(fd, [out.data], pos) == len(out)
            pieces = [(k * piece, k * piece, piece) for k in range(count)]
            for at, buf in h5data._filled(pieces, landing, fill):
                landing.land(at, buf)
            assert np.array_equal(live[:count * piece], data[:count * piece])
            assert (seen, len(landing._bounce)) == (threads, buffers)
    finally:
        os.close(fd)
