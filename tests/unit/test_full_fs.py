"""What ftkit writes on the PFS, on a real full file system (a small tmpfs; root only, skipped
with the reason elsewhere): an HDF5 file fails inside its writer and leaves nothing that can
fail later, the event log never holds a torn line, the completion marker and the run identity
degrade instead of failing the job."""
from __future__ import annotations

import gc
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ftkit.capture.flatten import flatten
from ftkit.capture.staging import Stager
from ftkit.jobdir import identity
from ftkit.jobdir.events import append_event, mark_progress, read_events
from ftkit.launch import marker
from ftkit.storage.pfs import hdf5
from ftkit.storage.shard import Shard, write_shard
from tests.mounts import fill, free_bytes, tmpfs


@pytest.fixture
def small(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "fs", "1m") as path:
        yield path


def _fill_datasets(h5: object, _sink: object) -> None:
    grp = h5.create_group("rank/0")  # type: ignore[attr-defined]
    for i in range(8):
        ds = grp.create_dataset(f"t{i}", data=np.ones(64 << 10, dtype=np.float32))
        ds.attrs["checksum"] = "x" * 64


def test_hdf5_write_on_a_full_fs_fails_inside_the_writer(small: Path) -> None:
    """Before: the ENOSPC of libhdf5 surfaced later from an h5py destructor (on whichever
    thread collected it) and the temp file stayed. Now the writer raises the file system's
    OSError naming the temp file, removes it, and collecting garbage afterwards, here and on
    another thread, raises nothing."""
    unraisable: list[object] = []
    hook = threading.excepthook
    threading.excepthook = unraisable.append      # type: ignore[assignment]
    try:
        with pytest.raises(OSError, match=r"No space left on device \(writing .*\.tmp\)") as err:
            hdf5._write_atomic(small / "node-0.h5", _fill_datasets)
        assert err.value.errno == 28
        assert sorted(p.name for p in small.iterdir()) == [], list(small.iterdir())
        del err
        gc.collect()
        worker = threading.Thread(target=gc.collect)
        worker.start()
        worker.join()
    finally:
        threading.excepthook = hook
    assert unraisable == []
    assert free_bytes(small) == 1 << 20          # every byte of the abandoned file is back


def test_raw_tensor_bytes_on_a_full_fs_fail_inside_the_writer(small: Path,
                                                              tmp_path: Path) -> None:
    """A large tensor's bytes are written by ftkit at their place in the file, not by
    libhdf5: ENOSPC there fails the same way, the temp file removed, every byte back."""
    tree, leaves = flatten({"w": np.ones(1 << 19, dtype=np.float32)})       # 2 MiB
    shard_path = tmp_path / "rank-0.ftk"
    write_shard(shard_path, {"job": "j", "step": 3, "rank": 0, "world": 1}, tree, leaves,
                Stager().capture(leaves))
    with Shard.open(shard_path, rank=0, step=3) as shard, \
            pytest.raises(OSError, match=r"No space left on device \(writing .*\.tmp\)") as err:
        hdf5.write_rank_file(small / "rank-0.h5", shard, {})
    assert err.value.errno == 28
    assert sorted(p.name for p in small.iterdir()) == []
    del err
    gc.collect()
    assert free_bytes(small) == 1 << 20


def test_hdf5_write_that_fits_is_unchanged(small: Path) -> None:
    digest = hdf5._write_atomic(small / "node-0.h5", lambda h5, _sink: h5.attrs.update(
        {"format": hdf5.FORMAT}))
    assert digest["size"] == (small / "node-0.h5").stat().st_size
    assert [p.name for p in small.iterdir()] == ["node-0.h5"]


def test_event_log_on_a_full_fs_has_no_torn_line(small: Path) -> None:
    """A line that does not fit is cut back entirely (before, a partial line joined the next
    one and both were lost); ``mark_progress`` still moves the modification time."""
    log = small / "events.jsonl"
    append_event(log, "first", n=1)
    ballast = fill(small)
    size, mtime = log.stat().st_size, log.stat().st_mtime_ns
    with pytest.raises(OSError):
        append_event(log, "big", pad="x" * 8192)
    assert log.stat().st_size == size
    mark_progress(log)
    assert log.stat().st_mtime_ns >= mtime
    ballast.unlink()
    append_event(log, "after", n=2)
    assert [e["event"] for e in read_events(log)] == ["first", "after"]
    assert all(json.loads(line) for line in log.read_text().splitlines())


def test_completion_marker_on_a_full_fs_is_the_renamed_placeholder(
        small: Path, caplog: pytest.LogCaptureFixture) -> None:
    done = small / "job" / ".done-attempt-0"
    marker.prepare(done)
    assert marker.pending_path(done).is_file()
    fill(small)
    with caplog.at_level(logging.WARNING, logger="ftkit.launch.marker"):
        marker.write_done(done, {"job": "j", "stopped": False, "pad": "x" * 8192})
    assert done.is_file() and done.stat().st_size == 0
    assert not marker.pending_path(done).exists()
    assert marker.read_marker(done) == {}
    assert "renaming its placeholder" in caplog.text


def test_completion_marker_on_a_full_fs_holds_the_record_in_the_placeholders_blanks(
        small: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The PFS filled up during the attempt: the record (where the newest steps are) is
    written over the placeholder's blanks, so ``ftkit run`` can still say it; rewriting it
    (in-job's release mark) works in place too."""
    done = small / "job" / ".done-attempt-0"
    marker.prepare(done)
    assert marker.pending_path(done).stat().st_size == marker.PLACEHOLDER_BYTES
    fill(small)
    record = {"job": "j", "last_committed": 8, "unflushed": {"step": 8, "why": "ENOSPC",
                                                             "last_flushed": None}}
    with caplog.at_level(logging.WARNING, logger="ftkit.launch.marker"):
        marker.write_done(done, record)
    assert "the record written over its blanks" in caplog.text
    assert marker.read_marker(done) == record and not marker.pending_path(done).exists()
    marker.write_done(done, {"in_job": {"released": True}})
    assert marker.read_marker(done) == {"in_job": {"released": True}}
    marker.write_done(done, {"pad": "x" * 8192})          # does not fit: left as it was
    assert marker.read_marker(done) == {"in_job": {"released": True}}


def test_a_pfs_full_before_the_attempt_gets_an_empty_placeholder(
        small: Path, caplog: pytest.LogCaptureFixture) -> None:
    done = small / "job" / ".done-attempt-0"
    done.parent.mkdir()
    fill(small)
    with caplog.at_level(logging.WARNING, logger="ftkit.launch.marker"):
        marker.prepare(done)
    assert marker.pending_path(done).stat().st_size == 0
    assert "no room for the completion record's placeholder" in caplog.text
    marker.write_done(done, {"job": "j"})
    assert done.is_file() and marker.read_marker(done) == {}


def test_completion_marker_without_placeholder_is_an_error_not_a_crash(
        small: Path, caplog: pytest.LogCaptureFixture) -> None:
    done = small / "job" / ".done-attempt-0"
    done.parent.mkdir()
    fill(small)
    marker.write_done(done, {"pad": "x" * 8192})
    assert not done.exists()
    assert "will count this finished attempt as failed" in caplog.text


def test_completion_marker_with_room_is_the_record(tmp_path: Path) -> None:
    done = tmp_path / "job" / ".done-attempt-0"
    marker.prepare(done)
    marker.write_done(done, {"job": "j", "stopped": True})
    assert marker.read_marker(done) == {"job": "j", "stopped": True}
    marker.cleanup(done)
    assert not marker.pending_path(done).exists()


def test_run_identity_on_a_full_fs_uses_the_launch_id(
        small: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Before: ConfigError (the job stopped, not retried). Now ``ftkit run``'s launch id is
    used unrecorded; once the file system has room, the next attempt records it."""
    job = small / "job"
    job.mkdir()
    ballast = fill(small)
    assert identity.run_id(job, "job", candidate="job-L1") == "job-L1"
    assert not (job / identity.RUN_FILE).exists()
    assert "goes on as job-L1 unrecorded" in caplog.text
    assert identity.run_id(job, "job").startswith("job-")      # no launcher: a new id
    ballast.unlink()
    assert identity.run_id(job, "job", candidate="job-L1") == "job-L1"
    assert identity.run_id(job, "job", candidate="job-L2") == "job-L1"   # recorded wins
