"""PFS retention (``FTKIT_PFS_KEEP``): after step s is committed, rank 0 removes the committed
steps below s beyond the newest N; records go first (in the flush), files after (behind the
training, by the reaper thread); newer-numbered steps are left alone."""
from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest

from ftkit import Config
from ftkit.errors import ConfigError
from ftkit.storage.pfs import hdf5
from ftkit.storage.pfs.retention import Reaper, remove_files, retract_steps
from ftkit.storage.stepnames import step_name


def _job(tmp_path: Path, committed: list[int], incomplete: list[int]) -> Path:
    job = tmp_path / "job"
    for step in committed + incomplete:
        d = job / step_name(step)
        d.mkdir(parents=True)
        (d / "node-0.h5").write_bytes(b"x" * 10)
        if step in committed:
            hdf5.write_commit(d, {"step": step, "world": 1, "files": {}})
    return job


def prune_steps(job: Path, newest: int, keep: int) -> list[int]:
    gone = retract_steps(job, newest, keep)
    remove_files(job, gone)
    return gone


def _listing(job: Path) -> dict[str, bool]:
    return {d.name: (d / hdf5.COMMITTED).is_file() for d in sorted(job.iterdir())}


def test_keeps_the_newest_committed_steps_up_to_the_one_just_committed(tmp_path) -> None:
    job = _job(tmp_path, committed=[1, 2, 3, 5, 6, 9], incomplete=[4, 7])
    assert prune_steps(job, 6, 2) == [1, 2, 3]
    # 5 and 6 kept; 4 and 7 incomplete (the next flush's business); 9 of an abandoned
    # timeline, left until its number is flushed again
    assert _listing(job) == {step_name(4): False, step_name(5): True, step_name(6): True,
                             step_name(7): False, step_name(9): True}
    assert prune_steps(job, 6, 2) == []
    assert prune_steps(job, 6, 1) == [5]
    assert (job / step_name(6) / hdf5.COMMITTED).is_file()


def test_a_step_whose_files_cannot_go_is_left_incomplete_never_committed(
        tmp_path, monkeypatch, caplog) -> None:
    job = _job(tmp_path, committed=[1, 2, 3], incomplete=[])
    real = shutil.rmtree

    def stuck(path: Path, *args: object, **kwargs: object) -> None:
        if Path(path).name == step_name(1):
            raise PermissionError(13, "Permission denied", str(path))
        real(path, *args, **kwargs)        # type: ignore[arg-type]
    monkeypatch.setattr(shutil, "rmtree", stuck)
    assert prune_steps(job, 3, 1) == [1, 2]
    assert _listing(job) == {step_name(1): False, step_name(3): True}
    assert "PFS step 1" in caplog.text and "Permission denied" in caplog.text


@pytest.mark.parametrize("raw", ["0", "-1", "two"])
def test_pfs_keep_must_be_a_positive_count(raw: str) -> None:
    assert Config.load(env={"FTKIT_PFS_KEEP": "3"}).pfs_keep == 3
    assert Config.load(env={}).pfs_keep == 2
    with pytest.raises(ConfigError, match="FTKIT_PFS_KEEP"):
        Config.load(env={"FTKIT_PFS_KEEP": raw})


def test_the_reaper_deletes_behind_the_caller_and_wait_waits(tmp_path, monkeypatch) -> None:
    """The flush only retracts (durably); the files go on the reaper's thread, so the flush
    returns while they are still being deleted; ``wait`` (the next flush, ``Checkpointer.wait``,
    ``close``) returns once they are gone."""
    job = _job(tmp_path, committed=[1, 2, 3], incomplete=[])
    release, entered = threading.Event(), threading.Event()
    real = shutil.rmtree

    def slow(path: Path, *args: object, **kwargs: object) -> None:
        entered.set()
        assert release.wait(30)
        real(path, *args, **kwargs)        # type: ignore[arg-type]
    monkeypatch.setattr(shutil, "rmtree", slow)
    reaper = Reaper()
    gone = retract_steps(job, 3, 1)
    reaper.remove(job, gone)                          # returns with the deletion pending
    assert gone == [1, 2] and entered.wait(30)
    assert _listing(job) == {step_name(1): False, step_name(2): False, step_name(3): True}
    waiter = threading.Thread(target=reaper.wait)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()                          # still deleting: wait blocks
    release.set()
    waiter.join(30)
    assert not waiter.is_alive()
    assert _listing(job) == {step_name(3): True}
    reaper.close()

