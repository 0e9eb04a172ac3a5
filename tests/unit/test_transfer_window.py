"""A copy received straight into a slot keeps WINDOW chunk receives in flight and checks
each chunk the moment it lands, in file order (fake communicator: which receives are posted
when, not how MPI moves bytes; the MPI tier runs the real transfers)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ftkit import passes
from ftkit.capture.flatten import TensorLeaf
from ftkit.storage.redundancy import transfer
from ftkit.storage.shard import write_shard


class _Req:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.landed = buf, False

    def Test(self) -> bool:
        return self.landed


class _Comm:
    def __init__(self) -> None:
        self.posted: list[_Req] = []

    def Irecv(self, spec: list[object], source: int, tag: int) -> _Req:
        req = _Req(spec[0])        # type: ignore[arg-type]
        self.posted.append(req)
        return req


class _Slots:
    def __init__(self, view: np.ndarray) -> None:
        self.view = view
        self.published: list[Path] = []

    def claim(self, size: int) -> tuple[Path, np.ndarray]:
        return Path("slot"), self.view[:size]

    def publish(self, slot: Path, target: Path) -> None:
        self.published.append(target)


def _file(tmp_path: Path, nbytes: int, tensors: int = 1) -> bytes:
    """A shard of rank 1, step 5 holding ``tensors`` tensors of ``nbytes`` bytes each."""
    path = tmp_path / "rank-1.ftk"
    rng = np.random.default_rng(1)
    write_shard(path, {"job": "j", "step": 5, "rank": 1, "world": 2}, None,
                [TensorLeaf(f"t{i}", "numpy", "|u1", (nbytes,), nbytes)
                 for i in range(tensors)],
                [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(tensors)])
    return path.read_bytes()


def _receiver(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, want: bytes
              ) -> tuple[transfer.FileRecv, _Comm, _Slots]:
    monkeypatch.setattr(transfer, "CHUNK", 4096)
    comm, slots = _Comm(), _Slots(np.zeros(len(want), dtype=np.uint8))
    rx = transfer.FileRecv(comm, tmp_path / "copy.ftk", 1, 7,    # type: ignore[arg-type]
                           transfer.Verify("partner", 5, 2), slots)   # type: ignore[arg-type]
    rx.size[0] = len(want)
    rx.start()
    return rx, comm, slots


def _land(req: _Req, want: bytes, at: int) -> None:
    req.buf[:] = np.frombuffer(want, dtype=np.uint8, count=len(req.buf), offset=at)
    req.landed = True


def test_window_of_receives_each_checked_as_it_lands(monkeypatch, tmp_path) -> None:
    want = _file(tmp_path, 100_000)
    rx, comm, slots = _receiver(monkeypatch, tmp_path, want)
    size, chunks = transfer.CHUNK, -(-len(want) // transfer.CHUNK)
    assert chunks > 2 * transfer.WINDOW
    assert len(comm.posted) == transfer.WINDOW          # not every chunk at once
    before = passes.snapshot()
    i = 0
    while i < chunks:
        assert rx.check is not None and not rx.poll()
        if i + 1 < len(comm.posted):                    # two land, the later one first
            _land(comm.posted[i + 1], want, (i + 1) * size)
            rx.poll()
            assert rx.check.pos == i * size             # it waits for the one before it
            _land(comm.posted[i], want, i * size)
            i += 2
        else:
            _land(comm.posted[i], want, i * size)
            i += 1
        rx.poll()
        assert rx.check.pos == min(i * size, len(want))  # checked the moment they landed
        assert len(comm.posted) == min(chunks, i + transfer.WINDOW)   # the window refilled
    assert rx.done
    rx.finish()
    assert slots.published == [tmp_path / "copy.ftk"]
    moved = passes.since(before)
    assert moved["recv"] == len(want) and moved["hash"] == 0   # the check rode on it


def test_a_chunk_damaged_in_transfer_is_refused_when_it_lands(monkeypatch, tmp_path) -> None:
    want = bytearray(_file(tmp_path, 5_000, tensors=20))     # every tensor < 2 chunks
    want[60_000] ^= 0xFF
    rx, comm, _ = _receiver(monkeypatch, tmp_path, bytes(want))
    i = 0
    while rx.error is None:
        _land(comm.posted[i], bytes(want), i * transfer.CHUNK)
        rx.poll()
        i += 1
    # refused with the chunk that held the damage or the next one (where its tensor ends),
    # long before the copy is complete
    assert 60_000 // transfer.CHUNK <= i - 1 <= 60_000 // transfer.CHUNK + 1
    assert i < len(want) // transfer.CHUNK
    assert "checksum mismatch" in str(rx.error) and "rank 1" in str(rx.error)
