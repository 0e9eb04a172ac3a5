"""Corruption and bad input with real jobs: detected, named, never loaded, nothing lost."""
from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from ftkit.storage.shard import Shard
from tests.e2e.jobs import Result, run_toy, tree_digests


def _shard(res: Result, node: int, step: int, rank: int) -> Path:
    return res.local / f"node-{node}" / f"step-{step}" / f"rank-{rank}.ftk"


@pytest.mark.timeout(600)
def test_corrupted_newest_shard_falls_back_to_previous(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """A byte flipped in step 6's shard of rank 1 (right after it is written); rank 2 dies in
    step 6's commit phase, after the coordinator recorded the commit, so step 6 is the newest
    committed step and step 5 is still held (no rank can start step 7 before every rank
    finished step 6). Restore detects the corruption, uses step 5, says so in the log and
    events.jsonl, and the end result is still bit-exact."""
    spec = "corrupt:rank=1:step=6:level=local;kill:rank=2:step=6:phase=commit"
    res = run_toy(tmp_path, steps=8, FTKIT_FAULTS=spec)
    assert res.rc == 0, res.tail()
    assert [s["step"] for s in res.starts] == [0, 5], res.starts
    skips = [e for e in res.events() if e["event"] == "restore-skip"]
    assert len(skips) == 1 and skips[0]["step"] == 6, skips
    assert list(skips[0]["failures"]) == ["1"], skips
    assert "checksum mismatch" in skips[0]["failures"]["1"]
    assert "rank-1.ftk" in skips[0]["failures"]["1"]
    assert "committed step 6 is unusable" in res.stderr
    assert res.done["digest"] == reference_digest(4, 8)


def _complete_run(tmp_path: Path) -> Result:
    res = run_toy(tmp_path, steps=6, max_restarts=0)
    assert res.rc == 0, res.tail()
    return res


@pytest.mark.timeout(600)
@pytest.mark.parametrize("damage", ["truncate", "foreign", "other-rank"])
def test_damaged_shard_uses_previous_step(damage: str, tmp_path: Path,
                                          reference_digest: Callable[..., str]) -> None:
    first = _complete_run(tmp_path)
    victim = _shard(first, node=1, step=6, rank=2)
    if damage == "truncate":
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "foreign":
        victim.write_bytes(b'{"not": "a shard"}\n' * 100)
    else:  # a real shard, but of another rank, named like rank 2's
        victim.write_bytes(_shard(first, node=1, step=6, rank=3).read_bytes())
    res = run_toy(tmp_path, steps=8, max_restarts=0)
    assert res.rc == 0, res.tail()
    assert res.starts[0]["step"] == 5, res.starts
    skip = [e for e in res.events() if e["event"] == "restore-skip"]
    assert skip and skip[-1]["step"] == 6 and list(skip[-1]["failures"]) == ["2"], skip
    why = skip[-1]["failures"]["2"]
    assert str(victim) in why and "rank 2" in why and "step 6" in why, why
    expected = {"truncate": "truncated", "foreign": "not an ftkit shard",
                "other-rank": "shard has rank 3, expected 2"}[damage]
    assert expected in why, why
    assert res.done["digest"] == reference_digest(4, 8)


@pytest.mark.timeout(600)
def test_different_world_size_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    first = run_toy(tmp_path, n=2, ranks_per_node=1, steps=4, max_restarts=0)
    assert first.rc == 0, first.tail()
    before = tree_digests(first.local)
    res = run_toy(tmp_path, n=4, ranks_per_node=2, steps=6, max_restarts=2)
    assert res.rc == 3, res.tail()              # an error a relaunch would hit again
    [line] = res.attempt_lines()
    assert "not retried" in line and "UnrecoverableError" in line, line
    assert "written by a job of 2 ranks" in res.stderr, res.tail()
    assert "this job has 4" in res.stderr and "step 4" in res.stderr, res.tail()
    assert tree_digests(first.local) == before


@pytest.mark.timeout(300)
def test_unusable_local_dir_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    res = run_toy(tmp_path, steps=2, max_restarts=0, FTKIT_LOCAL_DIR=str(blocker / "local"))
    assert res.rc != 0
    assert "FTKIT_LOCAL_DIR is not usable" in res.stderr, res.tail()
    assert str(blocker / "local") in res.stderr and "rank 0" in res.stderr


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k,mode=0700", "tmpfs", str(mnt)],
                          check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.timeout(300)
def test_full_disk_aborts_checkpoint_and_keeps_previous(tmp_path: Path, tiny_tmpfs: Path
                                                        ) -> None:
    """Each rank's shard is ~31 KB: step 1 (4 shards) fits in 160 KiB, step 2's tentative
    copies do not. The checkpoint aborts with ENOSPC naming file, rank and step, and the
    committed step 1 stays intact and loadable."""
    res = run_toy(tmp_path, steps=4, max_restarts=0, FTKIT_LOCAL_DIR=str(tiny_tmpfs),
                  FTKIT_ASYNC="0")
    assert res.rc != 0
    assert "No space left on device" in res.stderr, res.tail()
    assert "checkpoint of step 2 aborted" in res.stderr, res.tail()
    root = tiny_tmpfs / "e2e"
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        step1 = root / f"node-{node}" / "step-1"
        assert (step1 / "COMMITTED").is_file()
        for r in ranks:
            with Shard.open(step1 / f"rank-{r}.ftk", rank=r, step=1) as shard:
                shard.verify()
    leftovers = sorted(root.rglob("*.tmp")) + sorted(root.glob("node-*/step-2/rank-*.ftk"))
    assert not leftovers, leftovers
