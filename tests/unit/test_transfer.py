"""ftkit.storage.redundancy.transfer: shards verified while they stream in (StreamCheck), exchange on a
one-rank communicator (sending to itself), request hygiene after errors, and the bulk
deadline rule of DistComm (with a fake clock)."""
from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from ftkit import passes, progress
from ftkit.capture.flatten import TensorLeaf
from ftkit.comm import dist
from ftkit.comm.dist import DistComm
from ftkit.errors import CorruptCheckpointError, ProtocolTimeout
from ftkit.faults import Faults
from ftkit.storage.redundancy import erasure, gf256
from ftkit.storage.redundancy.transfer import StreamCheck, Verify, exchange, recv_buffer
from ftkit.storage.shard import READ_CHUNK, Shard, checksum, write_shard

STEP, OWNER = 5, 0


def make_shard(path: Path, *, rank: int = OWNER, step: int = STEP, world: int = 1,
               sizes: tuple[int, ...] = (1000, 0, 3, 70_000, 129)) -> bytes:
    """A real shard with tensors of awkward sizes (empty, unaligned); returns its bytes."""
    rng = np.random.default_rng(rank + 7 * step)
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    leaves = [TensorLeaf(f"t/{i}", "numpy", "|u1", (n,), n) for i, n in enumerate(sizes)]
    write_shard(path, {"job": "unit", "step": step, "rank": rank, "world": world},
                {"t": "dict", "items": [[f"t{i}", {"t": "tensor", "i": i}]
                                        for i in range(len(sizes))]}, leaves, bufs)
    return path.read_bytes()


def feed_all(data: bytes, piece: int, **kw: object) -> StreamCheck:
    args = {"source": 3, "rank": OWNER, "step": STEP, "world": 1, "level": "partner"} | kw
    check = StreamCheck(Path("/x/partner-0.ftk"), len(data), **args)  # type: ignore[arg-type]
    arr = np.frombuffer(data, dtype=np.uint8)
    for i in range(0, len(arr), piece):
        check.feed(arr[i:i + piece])
    check.finish()
    return check


# ------------------------------------------------------------------ StreamCheck
@pytest.mark.parametrize("piece", [1, 7, 64, 4096, 1 << 30])
def test_intact_shard_passes_in_any_piece_size(tmp_path: Path, piece: int) -> None:
    data = make_shard(tmp_path / "s.ftk", sizes=(1000, 0, 3, 700, 129) if piece < 64
                      else (1000, 0, 3, 70_000, 129))
    check = feed_all(data, piece)
    assert check.header is not None and len(check.header["tensors"]) == 5


def test_every_flipped_byte_is_refused(tmp_path: Path) -> None:
    """Preamble, header, padding, tensor bytes, last byte: no byte of the copy is unchecked."""
    data = make_shard(tmp_path / "s.ftk", sizes=(100, 0, 3, 200, 65))
    for pos in range(len(data)):
        bad = bytearray(data)
        bad[pos] ^= 0x01
        with pytest.raises(CorruptCheckpointError) as info:
            feed_all(bytes(bad), 64)
        msg = str(info.value)
        assert "/x/partner-0.ftk" in msg and "from rank 3" in msg, (pos, msg)
        assert "level partner" in msg and f"rank {OWNER}" in msg and f"step {STEP}" in msg


def test_mismatch_raised_while_streaming_not_at_the_end(tmp_path: Path) -> None:
    """The chunk that completes a damaged tensor raises; later chunks are never needed."""
    data = bytearray(make_shard(tmp_path / "s.ftk", sizes=(1000, 70_000)))
    with Shard.open(tmp_path / "s.ftk") as shard:
        first = shard.tensors[0]["offset"]
    data[first + 500] ^= 0xFF                          # inside the first tensor
    check = StreamCheck(Path("p"), len(data), source=1, rank=OWNER, step=STEP, world=1,
                        level="partner")
    arr = np.frombuffer(bytes(data), dtype=np.uint8)
    check.feed(arr[:first + 600])                      # the damaged tensor is incomplete
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in tensor t/0"):
        check.feed(arr[first + 600:first + 4096])
    assert check.pos == first + 4096 < len(data)


@pytest.mark.parametrize(("kw", "needle"), [
    ({"rank": 1}, "rank 0, expected 1"), ({"step": 6}, "step 5, expected 6"),
    ({"world": 4}, "world size 1, expected 4")])
def test_identity_is_checked(tmp_path: Path, kw: dict[str, int], needle: str) -> None:
    data = make_shard(tmp_path / "s.ftk")
    with pytest.raises(CorruptCheckpointError, match=needle):
        feed_all(data, 4096, **kw)


def test_truncated_or_overlong_stream(tmp_path: Path) -> None:
    data = make_shard(tmp_path / "s.ftk")
    for cut in (10, 40, len(data) - 1):
        check = StreamCheck(Path("p"), len(data), source=1, rank=OWNER, step=STEP, world=1,
                            level="partner")
        check.feed(np.frombuffer(data[:cut], dtype=np.uint8))
        with pytest.raises(CorruptCheckpointError, match="truncated|incomplete"):
            check.finish()
    check = StreamCheck(Path("p"), 8, source=1, rank=OWNER, step=STEP, world=1, level="x")
    with pytest.raises(CorruptCheckpointError, match="more than the 8 bytes"):
        check.feed(np.zeros(9, dtype=np.uint8))
    with pytest.raises(CorruptCheckpointError, match="not an ftkit shard"):
        feed_all(b"\0" * 100, 100)


# --------------------------------------------------- exchange on COMM_SELF
@pytest.fixture
def dc():
    comm = DistComm(MPI.COMM_SELF, timeout=20.0)
    yield comm
    assert comm.reap() == 0
    comm.free()


def _verify(faults: Faults | None = None) -> Verify:
    tamper = None if faults is None else (
        lambda buf: faults.corrupt_buffer(buf, level="partner", step=STEP))
    return Verify("partner", STEP, 1, tamper=tamper)


def test_exchange_to_self_delivers_verified_copy(dc: DistComm, tmp_path: Path) -> None:
    data = make_shard(tmp_path / "rank-0.ftk")
    exchange(dc, [(tmp_path / "rank-0.ftk", 0)], [(tmp_path / "copy.ftk", 0)], "encode", STEP,
             verify=_verify())
    assert (tmp_path / "copy.ftk").read_bytes() == data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.ftk", "rank-0.ftk"]


def test_corrupted_transfer_refused_then_next_exchange_fine(dc: DistComm,
                                                            tmp_path: Path) -> None:
    """Before this change the copy was written and kept whatever arrived."""
    data = make_shard(tmp_path / "rank-0.ftk")
    faults = Faults(f"corrupt:rank=0:step={STEP}:level=partner", rank=0, node=0, attempt=0)
    with pytest.raises(CorruptCheckpointError) as info:
        exchange(dc, [(tmp_path / "rank-0.ftk", 0)], [(tmp_path / "copy.ftk", 0)], "encode",
                 STEP, verify=_verify(faults))
    msg = str(info.value)
    assert "copy.ftk" in msg and "from rank 0" in msg and "level partner" in msg
    assert f"step {STEP}" in msg and "checksum mismatch" in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.ftk"]   # no copy, no tmp
    # the fault fired once; the same transfer again is intact
    exchange(dc, [(tmp_path / "rank-0.ftk", 0)], [(tmp_path / "copy.ftk", 0)], "encode", STEP,
             verify=_verify(faults))
    assert (tmp_path / "copy.ftk").read_bytes() == data


def test_exchange_deadline_scales_with_bytes(dc: DistComm, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    size = len(make_shard(tmp_path / "rank-0.ftk"))
    asked: list[int] = []
    real = DistComm.bulk_deadline
    monkeypatch.setattr(DistComm, "bulk_deadline",
                        lambda self, n: asked.append(n) or real(self, n))
    exchange(dc, [(tmp_path / "rank-0.ftk", 0)], [(tmp_path / "copy.ftk", 0)], "encode", STEP)
    assert asked == [2 * size]               # the bytes sent plus the bytes received


def test_failed_receive_is_cancelled_and_a_later_one_gets_the_right_bytes(
        dc: DistComm, tmp_path: Path) -> None:
    """A receive that timed out must not stay posted: before, it swallowed the next file's
    size message and the next exchange timed out (or got the old file's bytes)."""
    dc.timeout = 0.3
    with pytest.raises(ProtocolTimeout):
        exchange(dc, [], [(tmp_path / "lost.ftk", 0)], "encode", STEP)   # nobody sends
    data = make_shard(tmp_path / "rank-0.ftk")
    dc.timeout = 20.0
    exchange(dc, [(tmp_path / "rank-0.ftk", 0)], [(tmp_path / "copy.ftk", 0)], "encode",
             STEP, verify=_verify())
    assert (tmp_path / "copy.ftk").read_bytes() == data
    assert not (tmp_path / "lost.ftk").exists()


def test_recv_buffer_reads_what_exchange_sends(dc: DistComm, tmp_path: Path) -> None:
    data = make_shard(tmp_path / "rank-0.ftk")
    dc.timeout = 0.3
    with pytest.raises(ProtocolTimeout):
        recv_buffer(dc, 0, "flush", STEP)              # nobody sends: released
    dc.timeout = 20.0
    # a sender posts, then the receive runs (both on this rank: the sends are non-blocking)
    from ftkit.storage.redundancy.transfer import FileSend
    peer = DistComm(dc.comm, dc.timeout, dup=False)     # the sender's own tag sequence
    peer.bulk_tag(STEP, 0, 0)                           # it took part in the failed call
    tx = FileSend(tmp_path / "rank-0.ftk", 0, peer.bulk_tag(STEP, 0, 0))
    tx.post(dc.comm)
    got = recv_buffer(dc, 0, "flush", STEP)
    MPI.Request.Waitall(tx.reqs)
    tx.close()
    assert got.tobytes() == data


# ---------------------------------------------------------------- bulk deadlines
class FakeTime:
    """A clock that advances 0.25 s per reading; sleep does nothing."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 0.25
        return self.now

    def sleep(self, _s: float) -> None:
        pass


def test_bulk_deadline_rule() -> None:
    dc = DistComm(MPI.COMM_SELF, timeout=30.0, dup=False)
    assert dist.MIN_BULK_BANDWIDTH == 50e6
    assert dc.bulk_deadline(0) == 30.0
    assert dc.bulk_deadline(10 * 10**9) == pytest.approx(30.0 + 200.0)   # 10 GB at 50 MB/s
    assert dc.bulk_deadline(-5) == 30.0


@pytest.mark.parametrize(("nbytes", "limit"), [(None, 2.0), (0, 2.0), (150_000_000, 5.0)])
def test_waitall_deadline_control_vs_bulk(monkeypatch: pytest.MonkeyPatch,
                                          nbytes: int | None, limit: float) -> None:
    """Control waits end at FTKIT_TIMEOUT; a bulk wait of n bytes at timeout + n / 50 MB/s."""
    clock = FakeTime()
    monkeypatch.setattr(dist, "time", types.SimpleNamespace(monotonic=clock.monotonic,
                                                            sleep=clock.sleep))
    dc = DistComm(MPI.COMM_SELF, timeout=2.0)
    req = dc.comm.Irecv([np.zeros(1, np.uint8), MPI.BYTE], 0, 77)      # never satisfied
    with pytest.raises(ProtocolTimeout) as info:
        dc.waitall([req], "encode", 3, nbytes=nbytes)
    assert limit < clock.now - 0.25 <= limit + 0.25
    if nbytes:
        assert "150000000 bytes at 50 MB/s" in str(info.value)
    else:
        assert "FTKIT_TIMEOUT" in str(info.value)
    dc.release([req])
    assert dc.reap() == 0 and not req
    dc.free()


def test_bandwidth_constant_drives_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "MIN_BULK_BANDWIDTH", 1e6)
    assert DistComm(MPI.COMM_SELF, timeout=1.0, dup=False).bulk_deadline(3_000_000) == 4.0


def test_bulk_tags_fresh_per_transfer_and_agreed() -> None:
    a = DistComm(MPI.COMM_SELF, timeout=1.0, dup=False)
    b = DistComm(MPI.COMM_SELF, timeout=1.0, dup=False)
    first = [a.bulk_tag(7, 1, 2) for _ in range(3)]
    assert len(set(first)) == 3                               # fresh per transfer
    assert [b.bulk_tag(7, 1, 2) for _ in range(3)] == first   # same sequence on the peer
    assert a.bulk_tag(8, 1, 2) not in first and a.bulk_tag(7, 2, 1) == first[0]
    assert all(dist.TAG_FLOOR <= t <= MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) for t in first)


# ----------------------------------------------------------------- parity folds
def test_fold_is_linear_over_gf256_and_sees_any_short_corruption() -> None:
    rng = np.random.default_rng(3)
    s = 64 * 37                                  # not a multiple of FOLD: a padded tail
    a, b = (rng.integers(0, 256, s, dtype=np.uint8) for _ in range(2))
    for c in (1, 2, 0x53, 0xFF):
        lhs = erasure.fold(gf256.scale_into(np.empty(s, np.uint8), c, a) ^ b)
        rhs = gf256.scale_into(np.empty(erasure.FOLD, np.uint8), c, erasure.fold(a)) \
            ^ erasure.fold(b)
        assert np.array_equal(lhs, rhs)
    base = erasure.fold(a)
    for pos in range(0, s, 97):
        bad = a.copy()
        bad[pos] ^= 0x10
        assert not np.array_equal(erasure.fold(bad), base), pos


def _fold_by_definition(seg: np.ndarray) -> np.ndarray:
    padded = np.concatenate([seg, np.zeros(-len(seg) % erasure.FOLD, np.uint8)])
    out = np.zeros(erasure.FOLD, np.uint8)
    for a in range(0, len(padded), erasure.FOLD):
        out ^= padded[a:a + erasure.FOLD]
    return out


@pytest.mark.parametrize("nbytes", [8, 512 * 3, 8 * 1024 * 5, 8 * 1024 * 3 + 64 * 5,
                                    (1 << 20) + 8 * 1000])
def test_fold_of_wide_rows_equals_its_definition(nbytes: int) -> None:
    seg = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    assert np.array_equal(erasure.fold(seg), _fold_by_definition(seg))


def test_fold_and_checksum_is_one_hash_pass_over_many_chunks() -> None:
    seg = np.random.default_rng(9).integers(0, 256, 3 * READ_CHUNK + 4096, dtype=np.uint8)
    before = passes.snapshot()
    got, digest = erasure.fold_and_checksum(seg)
    assert passes.since(before)["hash"] == len(seg)
    assert np.array_equal(got, _fold_by_definition(seg)) and digest == checksum(seg)
