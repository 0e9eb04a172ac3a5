"""Block checksums of PFS rank files: every tensor of several 4 MiB blocks records the
xxh3-64 of each block (``block_checksums``), so a reshard reads and checks only the blocks
it needs (``StepReader.read_blocks``) and ``ftkit verify`` checks them against the data."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import xxhash

import ftkit
from ftkit import passes
from ftkit.capture.apply import load_into
from ftkit.capture.landing import Gate
from ftkit.cli.main import main
from ftkit.errors import CorruptCheckpointError
from ftkit.recovery import boxes
from ftkit.recovery.reshard import Resharded
from ftkit.storage.pfs import hdf5
from ftkit.storage.pfs.h5data import BlockSums
from ftkit.storage.pfs.h5read import StepReader
from tests.unit.test_cli_hostile import _edit
from tests.unit.test_hdf5_meta import write_step
from tests.unit.test_reshard import Coords, Topo

torch = pytest.importorskip("torch")
ROWS, COLS = 1024, 2048          # float32: 8 MiB, 2 blocks per saved half
BLOCK = hdf5.BLOCK_BYTES


def _full() -> Any:
    return torch.arange(2 * ROWS * COLS, dtype=torch.float32).reshape(2 * ROWS, COLS)


def _half(full: Any, t: int) -> dict[str, Any]:
    w = ftkit.declare_shard(full[t * ROWS:(t + 1) * ROWS].clone(), (2 * ROWS, COLS),
                            (t * ROWS, 0))
    return {"w": w, "small": torch.ones(20000)}          # 80 KB: one block, none recorded


def _step(tmp_path: Path) -> Path:
    step_dir = tmp_path / "job" / "step-1"
    write_step(step_dir, [_half(_full(), t) for t in range(2)], tp=2, rank_files=True)
    return step_dir


def test_rank_files_record_a_checksum_per_block(tmp_path: Path) -> None:
    step_dir = _step(tmp_path)
    with h5py.File(step_dir / "rank-1.h5", "r") as h5:
        w, small = h5["rank/1/w"], h5["rank/1/small"]
        assert w.attrs["block_bytes"] == BLOCK
        data = w[()].view(np.uint8).reshape(-1)
        want = [xxhash.xxh3_64_intdigest(data[i:i + BLOCK].data)
                for i in range(0, data.nbytes, BLOCK)]
        assert w.attrs["block_checksums"].tolist() == want and len(want) == 2
        assert "block_checksums" not in small.attrs
    assert main(["verify", str(step_dir)]) == 0


def test_block_sums_of_pieces_of_any_size() -> None:
    data = np.random.default_rng(1).integers(0, 255, 10_000, dtype=np.uint8)
    sums = BlockSums(4096)
    for lo, hi in ((0, 1), (1, 5000), (5000, 8192), (8192, 10_000)):
        sums.update(data[lo:hi].data)
    assert sums.done() == [xxhash.xxh3_64_intdigest(data[i:i + 4096].data)
                           for i in range(0, 10_000, 4096)]


def _reshard_into(step_dir: Path, state: dict[str, Any], rank: int) -> dict[str, int]:
    before = passes.snapshot()
    with StepReader(step_dir, 1) as reader:
        groups = {r: reader.group(r) for r in range(2)}
        opened = Resharded(reader, groups, Topo(rank, Coords(tp=rank)), state, 1)
        opened.read(Gate(), lambda n: None)
        load_into(state, opened.reading.tree, 1)
    return passes.since(before)


def test_a_reshard_reads_only_the_blocks_it_needs(tmp_path: Path) -> None:
    """At tp 4 a rank needs a quarter of the global rows: half of one saved tensor, its
    first or second block — 4 MiB read instead of 8 — and gets exactly its rows."""
    step_dir = _step(tmp_path)
    full = _full()
    q = ROWS // 2
    for t in range(4):
        state = {"w": ftkit.declare_shard(torch.zeros(q, COLS), (2 * ROWS, COLS), (t * q, 0)),
                 "small": torch.zeros(20000)}
        moved = _reshard_into(step_dir, state, t)
        assert torch.equal(state["w"], full[t * q:(t + 1) * q]), t
        assert moved["read"] == BLOCK + 80_000, moved


def test_a_damaged_block_is_caught_when_read_and_only_then(tmp_path: Path) -> None:
    """A flipped byte in the second block of rank 0's ``w``: the tp 4 rank that needs the
    first block does not read it and restores; the one that needs the second is refused,
    naming the block."""
    step_dir = _step(tmp_path)
    with h5py.File(step_dir / "rank-0.h5", "r") as h5:
        offset = h5["rank/0/w"].id.get_offset()
    with open(step_dir / "rank-0.h5", "r+b") as fh:
        fh.seek(offset + BLOCK + 10)
        byte = fh.read(1)
        fh.seek(offset + BLOCK + 10)
        fh.write(bytes([byte[0] ^ 0xFF]))
    q = ROWS // 2

    def state(t: int) -> dict[str, Any]:
        return {"w": ftkit.declare_shard(torch.zeros(q, COLS), (2 * ROWS, COLS), (t * q, 0)),
                "small": torch.zeros(20000)}
    good = state(0)
    _reshard_into(step_dir, good, 0)
    assert torch.equal(good["w"], _full()[:q])
    with pytest.raises(CorruptCheckpointError, match=r"rank-0.h5:/rank/0/w .*block 1 "
                                                     r"\(bytes 4194304\.\.8388608\) does not "
                                                     r"match its checksum"):
        _reshard_into(step_dir, state(1), 1)


def test_verify_checks_the_block_checksums(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A block checksum that does not match the data (a writer bug; the file resealed and
    recommitted, so only this check can tell) is reported by verify."""
    step_dir = _step(tmp_path)

    def wrong(h5: Any) -> None:
        sums = h5["rank/1/w"].attrs["block_checksums"]
        sums[1] ^= 1
        h5["rank/1/w"].attrs["block_checksums"] = sums
    _edit(step_dir / "rank-1.h5", wrong, seal="rank/1")
    assert main(["verify", str(step_dir)]) == 1
    assert "block 1 does not match its block checksum" in capsys.readouterr().out


def test_block_checksums_that_do_not_cover_the_tensor_are_refused(tmp_path: Path) -> None:
    step_dir = _step(tmp_path)

    def short(h5: Any) -> None:
        h5["rank/1/w"].attrs["block_checksums"] = np.zeros(3, dtype=np.uint64)
    _edit(step_dir / "rank-1.h5", short, seal="rank/1")
    with StepReader(step_dir, 1) as reader, \
            pytest.raises(CorruptCheckpointError, match=r"block_checksums \(3 of them\) do "
                                                        r"not cover 8388608 bytes"):
        reader.group(1)


def test_byte_spans_and_blocks() -> None:
    box = boxes.Chunk((0, 0), (4, 8))
    src = boxes.Source(0, 0, 0, box)
    rows = boxes.Copy(src, boxes.Chunk((1, 0), (2, 8)), box, 0)
    assert boxes.byte_span(rows, 4) == (32, 96)
    cols = boxes.Copy(src, boxes.Chunk((0, 2), (4, 2)), box, 0)
    assert boxes.byte_span(cols, 4) == (8, 112)            # first to last element
    assert boxes.blocks_needed([(32, 96)], 32, 128) == [1, 2]
    assert boxes.blocks_needed([(0, 128)], 32, 128) is None
    assert boxes.blocks_needed([(0, 10), (100, 101)], 32, 128) == [0, 3]
