"""Crafted HDF5 checkpoints cannot make a reader leave the step directory, read another
step's or job's data, allocate what the file does not hold, or wait forever.

The crafted files are made *consistent* (seals and COMMITTED digests recomputed, as an
attacker or a buggy tool could): only the structural checks of ``ftkit.storage.pfs.h5read`` /
``h5files`` stand between them and a restore.
"""
from __future__ import annotations

import functools
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import h5py
import numpy as np
import pytest

from ftkit.capture.landing import Gate
from ftkit.errors import CorruptCheckpointError
from ftkit.recovery import pfs_restore
from ftkit.storage.pfs import h5files, hdf5
from ftkit.storage.pfs.h5read import StepReader
from tests.unit.test_hdf5_meta import _OneRank, _Pfs, _state, write_step


def _recommit(step_dir: Path) -> None:
    """Record every HDF5 file's current digest in COMMITTED (as a crafted step would)."""
    record = hdf5.read_commit(step_dir)
    record["files"] = {p.name: h5files.file_digest(p) for p in sorted(step_dir.glob("*.h5"))}
    hdf5.write_commit(step_dir, record)


def _craft(path: Path, fn: Any) -> None:
    """Edit an HDF5 file, reseal what a reader checks, and recommit the step."""
    with h5py.File(path, "r+") as h5:
        fn(h5)
        if "rank" in h5:
            for name in h5["rank"]:
                if isinstance(h5["rank"].get(name, getlink=True), h5py.HardLink):
                    hdf5.seal(h5[f"rank/{name}"])
        hdf5.seal(h5)
    _recommit(path.parent)


def _replace_dataset(h5: Any, path: str, **create: Any) -> None:
    """Replace dataset ``path`` by one made with ``create`` keeping its ftkit attributes."""
    attrs = dict(h5[path].attrs)
    del h5[path]
    ds = h5.create_dataset(path, **create)
    ds.attrs.update(attrs)


@pytest.fixture
def step(tmp_path: Path) -> Path:
    d = tmp_path / "job" / "step-4"
    write_step(d, [_state(0), _state(1)], step=4, ranks_per_node=1)
    return d


def _refused(step_dir: Path, match: str, *, rank: int = 0, **kw: Any) -> str:
    with pytest.raises(CorruptCheckpointError, match=match) as err, \
            StepReader(step_dir, 4, **kw) as reader:
        reader.read(rank)
    return str(err.value)


def test_external_link_out_of_the_step_directory_is_not_followed(step: Path, tmp_path: Path
                                                                 ) -> None:
    """Before: the index's ExternalLink was followed by HDF5 wherever it pointed."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "node-0.h5").write_bytes((step / "node-0.h5").read_bytes())

    def relink(h5: Any) -> None:
        del h5["rank/0"]
        h5["rank/0"] = h5py.ExternalLink("../../elsewhere/node-0.h5", "/rank/0")
    _craft(step / "ftkit.h5", relink)
    why = _refused(step, "only /rank/0 of a node-<id>.h5 file in the step directory")
    assert "../../elsewhere/node-0.h5" in why


def test_link_to_another_ranks_group_is_refused(step: Path) -> None:
    def relink(h5: Any) -> None:
        del h5["rank/0"]
        h5["rank/0"] = h5py.ExternalLink("node-1.h5", "/rank/1")
    _craft(step / "ftkit.h5", relink)
    _refused(step, r"links to node-1.h5:/rank/1")


def test_missing_node_file_is_not_looked_up_in_the_working_directory(
        step: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: HDF5 fell back to the working directory for a missing external file: another
    step's node-1.h5 there was loaded as step 4's rank 1."""
    other = tmp_path / "other" / "step-2"
    write_step(other, [_state(0, pos=2), _state(1, pos=2)], step=2, ranks_per_node=1)
    (step / "node-1.h5").unlink()
    monkeypatch.chdir(other)
    _refused(step, r"node-1.h5 .*cannot read", rank=1)


def test_node_file_of_another_step_is_refused(step: Path, tmp_path: Path) -> None:
    """A consistent step-2 node file placed into step 4 (digests recomputed): the group
    says step 2."""
    other = tmp_path / "other" / "step-2"
    write_step(other, [_state(0, pos=2), _state(1, pos=2)], step=2, ranks_per_node=1)
    (step / "node-1.h5").write_bytes((other / "node-1.h5").read_bytes())
    _recommit(step)
    _refused(step, "group says step 2, expected 4", rank=1)


# ------------------------------------------------- rank files (the layout flushes write)

@pytest.fixture
def ranked(tmp_path: Path) -> Path:
    """Step 4 as the PFS level writes it: ``rank-<r>.h5`` hold the data, ``node-<id>.h5``
    link to them (2 ranks, one node)."""
    d = tmp_path / "ranked" / "step-4"
    write_step(d, [_state(0), _state(1)], step=4, ranks_per_node=2, rank_files=True)
    return d


def _relinked(step_dir: Path, file: str, target: str, path: str = "/rank/0") -> None:
    def relink(h5: Any) -> None:
        del h5["rank/0"]
        h5["rank/0"] = h5py.ExternalLink(target, path)
    _craft(step_dir / file, relink)


def test_rank_files_read_through_two_links_and_with_plain_h5py(ranked: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """The index links the node file, which links each rank's file: ftkit resolves both
    hops itself, and plain h5py (from another working directory) sees one checkpoint."""
    with StepReader(ranked, 4, require_commit=True) as reader:
        group, arrays = reader.read(1)
    assert group.file == str(ranked / "rank-1.h5")
    assert arrays[1].view(np.float32).tolist() == [8.0] * 6
    record = hdf5.read_commit(ranked, 4)
    assert sorted(record["files"]) == ["ftkit.h5", "node-0.h5", "rank-0.h5", "rank-1.h5"]
    assert record["files"]["node-0.h5"]["raw"] == []          # links only, no tensor data
    monkeypatch.chdir(tmp_path)
    with h5py.File(ranked / "ftkit.h5", "r") as h5:
        assert h5["rank/1/model/b"][()].tolist() == [[8.0] * 3] * 2


@pytest.mark.parametrize("target", ["rank-1.h5", "node-0.h5", "../rank-0.h5"])
def test_node_file_links_only_to_the_ranks_own_file(ranked: Path, target: str) -> None:
    _relinked(ranked, "node-0.h5", target)
    why = _refused(ranked, "only /rank/0 of rank-0.h5 in the step directory is followed")
    assert "node-0.h5:/rank/0" in why and target in why


def test_rank_file_links_nowhere(ranked: Path) -> None:
    """A rank file whose group is an external link (here to itself) is refused at once."""
    _relinked(ranked, "rank-0.h5", "rank-0.h5")
    _refused(ranked, "rank-0.h5:/rank/0 .*nothing: a rank file holds its group")


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """Step 4 as the PFS level writes it with FTKIT_PFS_FILES=shared: ``ranks.h5`` holds both
    ranks' groups, the index links to it."""
    d = tmp_path / "shared" / "step-4"
    write_step(d, [_state(0), _state(1)], step=4, shared=True)
    return d


def test_shared_file_reads_through_one_link_and_with_plain_h5py(shared: Path) -> None:
    assert sorted(p.name for p in shared.iterdir()) == ["COMMITTED", "ftkit.h5", "ranks.h5"]
    with StepReader(shared, 4) as reader:
        for rank in (0, 1):
            group, arrays = reader.read(rank)
            assert group.file == str(shared / "ranks.h5") and group.attrs["rank"] == rank
            assert np.array_equal(arrays[0].view(np.float32).reshape(2, 3),
                                  _state(rank)["model"]["a"])
    with h5py.File(shared / "ftkit.h5", "r") as h5:       # plain h5py follows the links
        assert np.array_equal(h5["rank/1/model/b"][()], _state(1)["model"]["b"])


def test_shared_file_holds_scalar_and_empty_tensors(tmp_path: Path) -> None:
    """Every dataset of a shared file is created before its bytes exist, scalars included
    (h5py's create_dataset would allocate a scalar late: no offset to write at)."""
    states = [{"s": np.array(1.5 + r, dtype=np.float32), "e": np.zeros((0, 3), np.int64),
               "v": np.arange(3, dtype=np.int16) + r} for r in range(2)]
    d = tmp_path / "job" / "step-4"
    write_step(d, states, step=4, shared=True)
    with StepReader(d, 4) as reader:
        for rank in (0, 1):
            group, arrays = reader.read(rank)
            got = {e["path"]: a for e, a in zip(group.entries, arrays)}
            assert got["s"].view(np.float32).tolist() == [1.5 + rank]
            assert got["e"].nbytes == 0 and got["v"].view(np.int16).tolist() == [rank,
                                                                                  rank + 1,
                                                                                  rank + 2]


def test_shared_file_links_nowhere(shared: Path) -> None:
    """The shared file's groups are its own: an external link there is refused."""
    _relinked(shared, "ranks.h5", "rank-0.h5")
    _refused(shared, "ranks.h5:/rank/0 .*nothing: the shared file holds every rank's group")


def test_index_may_link_straight_to_the_ranks_own_file(ranked: Path) -> None:
    _relinked(ranked, "ftkit.h5", "rank-0.h5")
    with StepReader(ranked, 4) as reader:
        assert reader.read(0)[0].file == str(ranked / "rank-0.h5")
    _relinked(ranked, "ftkit.h5", "rank-1.h5", "/rank/1")
    _refused(ranked, "links to rank-1.h5:/rank/1; only /rank/0 of a node-<id>.h5 file")


def test_rank_file_missing_from_the_record_is_refused(ranked: Path) -> None:
    record = hdf5.read_commit(ranked)
    del record["files"]["rank-0.h5"]
    hdf5.write_commit(ranked, record)
    _refused(ranked, "rank-0.h5 .*digest in COMMITTED is malformed")
    with StepReader(ranked, 4) as reader:          # the other rank's files are unaffected
        assert reader.read(1)[0].attrs["rank"] == 1


def test_damaged_rank_file_is_refused_before_it_is_opened(ranked: Path) -> None:
    data = bytearray((ranked / "rank-0.h5").read_bytes())
    data[100] ^= 0xFF                                # the superblock region: metadata
    (ranked / "rank-0.h5").write_bytes(bytes(data))
    _refused(ranked, "rank-0.h5 .*HDF5 metadata digest mismatch.*not opened")


def test_other_job_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "job" / "step-4"
    write_step(d, [_state(0)], step=4, job="someone-else", ranks_per_node=1)
    _refused(d, "belongs to job 'someone-else', not 'synth'", job="synth")


def test_external_raw_storage_is_refused(step: Path, tmp_path: Path) -> None:
    """Before: a dataset backed by another file (e.g. /etc/passwd) was read and exported."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(6, dtype=np.float32).tobytes())
    _craft(step / "node-0.h5", lambda h5: _replace_dataset(
        h5, "rank/0/model/a", shape=(2, 3), dtype="<f4", external=[(str(secret), 0, 24)]))
    _refused(step, "model/a.*external raw storage")


def test_virtual_dataset_is_refused(step: Path) -> None:
    def virtual(h5: Any) -> None:
        layout = h5py.VirtualLayout(shape=(2, 3), dtype="<f4")
        layout[:] = h5py.VirtualSource("node-1.h5", "rank/1/model/a", shape=(2, 3))
        attrs = dict(h5["rank/0/model/a"].attrs)
        del h5["rank/0/model/a"]
        h5["rank/0"].create_virtual_dataset("model/a", layout).attrs.update(attrs)
    _craft(step / "node-0.h5", virtual)
    _refused(step, "model/a.*virtual dataset")


def test_dataset_larger_than_its_file_is_refused_before_reading(tmp_path: Path) -> None:
    """An 8 GiB dataset declared in a small file (no storage allocated): before, reading it
    allocated 8 GiB of fill values."""
    d = tmp_path / "job" / "step-4"
    write_step(d, [{"w": np.zeros(4, dtype=np.float64)}], step=4, ranks_per_node=1)
    n = 1 << 30

    def huge(h5: Any) -> None:
        _replace_dataset(h5, "rank/0/w", shape=(n,), dtype="<f8")
        h5["rank/0/w"].attrs["ftkit_shape"] = np.asarray([n], dtype=np.int64)
        h5["rank/0/w"].attrs["global_shape"] = [n]
    _craft(d / "node-0.h5", huge)
    assert (d / "node-0.h5").stat().st_size < 64 << 10
    _refused(d, r"needs 8589934592 bytes but only 0 bytes of data are stored")


def test_soft_link_inside_a_rank_group_is_refused(step: Path) -> None:
    def soft(h5: Any) -> None:
        h5["rank/0/model/alias"] = h5py.SoftLink("/rank/1/model/a")
    _craft(step / "node-0.h5", soft)
    _refused(step, "'model/alias' is a SoftLink")


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_node_file_must_be_a_regular_file(step: Path, tmp_path: Path, kind: str) -> None:
    """A FIFO blocked the reader forever; a symlink could point anywhere."""
    target = step / "node-0.h5"
    copy = tmp_path / "copy.h5"
    copy.write_bytes(target.read_bytes())
    target.unlink()
    if kind == "symlink":
        target.symlink_to(copy)
    else:
        os.mkfifo(target)
    for commit in (True, False):
        _refused(step, "symbolic link" if kind == "symlink" else "not a regular file")
        if commit:
            (step / "COMMITTED").unlink()


def test_commit_record_is_checksummed(step: Path) -> None:
    text = (step / "COMMITTED").read_text()
    (step / "COMMITTED").write_text(text.replace('"world": 2', '"world": 3'))
    _refused(step, "commit record checksum mismatch")
    (step / "COMMITTED").write_text('{"step": 4, "world": 2}')
    _refused(step, "commit record checksum mismatch")


def test_restore_needs_the_file_digests(step: Path) -> None:
    """Restore never lets libhdf5 parse files it cannot check first."""
    record = hdf5.read_commit(step)
    del record["files"]
    hdf5.write_commit(step, record)
    _refused(step, "records no file digests", require_commit=True)
    (step / "COMMITTED").unlink()
    _refused(step, "COMMITTED .*cannot read", require_commit=True)


def test_a_hung_read_times_out_and_restore_goes_on(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """All ranks stuck in the same file-system read have no collective to time out in: the
    read runs under a no-progress deadline. Step 2's read hangs (a stalled file system); the
    step is skipped with a one-line reason, later steps are not read through the stuck
    library, and restore returns instead of hanging."""
    job = tmp_path / "job"
    write_step(job / "step-1", [_state(0, pos=1000)], step=1, ranks_per_node=1)
    write_step(job / "step-2", [_state(0, pos=1234)], step=2, ranks_per_node=1)
    release = threading.Event()
    real = pfs_restore._Opened.read

    def stalls_on_step_2(self: Any, gate: Any, progress: Any) -> None:
        if self.reader.step == 2:
            release.wait()
        real(self, gate, progress)
    monkeypatch.setattr(pfs_restore._Opened, "read", stalls_on_step_2)
    pfs = _Pfs(job, 1)
    pfs.config = SimpleNamespace(job="synth", timeout=0.5)
    events: list[tuple[str, dict[str, Any]]] = []
    t0 = time.monotonic()
    try:
        got, skipped = pfs_restore.restore_from_pfs(
            _OneRank(), pfs, _state(0, pos=0),  # type: ignore[arg-type]
            lambda ev, **kw: events.append((ev, kw)))
    finally:
        release.set()
    assert got == 0 and time.monotonic() - t0 < 30
    assert "made no progress for 0.5 s" in skipped[2]
    assert "an earlier PFS read is still stuck (step 2)" in skipped[1]
    assert all(map(pfs_restore.transient, skipped.values()))   # a relaunch is worth a try
    assert [kw["step"] for ev, kw in events if ev == "restore-skip"] == [2, 1]


def test_a_slow_but_progressing_read_is_not_cut_off(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline restarts on every tensor read: a read slower in total than the timeout
    but steadily progressing completes."""
    job = tmp_path / "job"
    state = {"t": {str(i): np.full(4, i, dtype=np.float32) for i in range(6)}}
    write_step(job / "step-1", [state], step=1, ranks_per_node=1)
    real = StepReader._tensor

    def slow(self: StepReader, *args: Any) -> Any:
        threading.Event().wait(0.15)         # a slow file system, 0.9 s in all
        return real(self, *args)
    monkeypatch.setattr(StepReader, "_tensor", slow)
    pfs = _Pfs(job, 1)
    pfs.config = SimpleNamespace(job="synth", timeout=0.5)
    live = {"t": {str(i): np.zeros(4, dtype=np.float32) for i in range(6)}}
    opened = pfs_restore._open(pfs, 1, live, lambda n: None)  # type: ignore[arg-type]
    try:
        pfs_restore.with_deadline(functools.partial(opened.read, Gate()), "reading", 0.5)
    finally:
        opened.reader.close()
    assert [float(live["t"][str(i)][0]) for i in range(6)] == [float(i) for i in range(6)]


def test_every_file_of_a_committed_step_needs_its_digest(step: Path) -> None:
    """A record that leaves a file out does not let that file reach libhdf5 unchecked."""
    record = hdf5.read_commit(step)
    del record["files"]["ftkit.h5"]
    hdf5.write_commit(step, record)
    _refused(step, "ftkit.h5 .*digest in COMMITTED is malformed")


def test_node_file_read_alone_is_checked_against_the_step_record(step: Path) -> None:
    """``ftkit inspect step-4/node-0.h5``: the step's COMMITTED digest still applies."""
    node = step / "node-0.h5"
    with h5py.File(node, "r+") as h5:
        h5["rank/0"].attrs["step"] = 5
    with pytest.raises(CorruptCheckpointError, match="node-0.h5 .*(digest mismatch|COMMITTED "
                                                     "recorded)"):
        StepReader(step, 4, file=node)
