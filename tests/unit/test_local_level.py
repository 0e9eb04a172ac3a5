"""ftkit.storage.local: node-local level layout, permissions, protocol calls, ENOSPC."""
from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ftkit.capture.flatten import flatten, leaf_from_bytes, unflatten
from ftkit.capture.staging import Stager
from ftkit.errors import CorruptCheckpointError
from ftkit.faults import Faults
from ftkit.fs import write_record
from ftkit.storage import slots
from ftkit.storage.level import Level
from ftkit.storage.local import COMMITTED, LocalLevel, make_private_dir
from ftkit.storage.shard import leaves_of

WORLD = 4


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _level(root: Path, rank: int = 0, leader: bool = True, spec: str = "") -> LocalLevel:
    return LocalLevel(root, rank=rank, node_leader=leader,
                      faults=Faults(spec, rank=rank, node=0, attempt=0))


def _write(level: LocalLevel, step: int, nbytes: int = 256, fill: int | None = None) -> Any:
    fill = step if fill is None else fill
    state = {"w": torch.full((nbytes // 4,), float(fill)), "n": np.int64(step), "step": step}
    tree, leaves = flatten(state)
    meta = {"job": "unit", "step": step, "rank": level.rank, "world": WORLD}
    level.write_tentative(step, meta, tree, leaves, Stager().capture(leaves))
    return state


def _commit(level: LocalLevel, step: int) -> None:
    record = {"step": step, "decision": "commit", "world": WORLD}
    level.record_commit(step, record)
    level.commit(step, record)


def _load(level: LocalLevel, step: int) -> Any:
    with level.open_shard(step) as shard:
        shard.verify()
        tensors = [leaf_from_bytes(lf, shard.raw(i).copy())
                   for i, lf in enumerate(leaves_of(shard.header))]
        return unflatten(shard.header["tree"], tensors)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "local" / "job" / "node-0"


# ------------------------------------------------------------- permissions
def test_is_a_level() -> None:
    assert issubclass(LocalLevel, Level) and LocalLevel.name == "local"


def test_prepare_creates_private_dirs(root: Path) -> None:
    old = os.umask(0o022)
    try:
        _level(root).prepare()
    finally:
        os.umask(old)
    assert _mode(root) == 0o700
    assert _mode(root.parent) == 0o700 and _mode(root.parent.parent) == 0o700
    assert list(root.iterdir()) == []           # the write probe is gone


def test_make_private_dir_tightens_existing(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    make_private_dir(d)
    assert _mode(d) == 0o700
    make_private_dir(d)                         # idempotent
    assert _mode(d) == 0o700


def test_make_private_dir_rejects_a_file(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(NotADirectoryError, match=str(f)):
        make_private_dir(f)


def test_step_dirs_and_shards_are_private(root: Path) -> None:
    level = _level(root, rank=3)
    level.prepare()
    old = os.umask(0o000)                       # even with a permissive umask
    try:
        _write(level, 5)
        _commit(level, 5)
    finally:
        os.umask(old)
    assert level.shard_path(5) == root / "step-5" / "rank-3.ftk"
    assert _mode(root / "step-5") == 0o700
    assert _mode(level.shard_path(5)) == 0o600
    assert _mode(root / "step-5" / COMMITTED) == 0o600


# ------------------------------------------------------- protocol sequence
def test_tentative_commit_inventory(root: Path) -> None:
    level = _level(root, rank=1)
    level.prepare()
    assert level.inventory() == {}
    state = _write(level, 4)
    assert level.inventory() == {4: {"committed": False, "have": True}}
    assert not level.is_committed(4)
    _commit(level, 4)
    assert level.inventory() == {4: {"committed": True, "have": True}}
    record = json.loads((root / "step-4" / COMMITTED).read_text())
    assert record["decision"] == "commit" and record["step"] == 4
    assert level.record_world(4) == WORLD
    out = _load(level, 4)
    assert torch.equal(out["w"], state["w"]) and out["step"] == 4
    assert sorted(p.name for p in (root / "step-4").iterdir()) == [COMMITTED, "rank-1.ftk"]


def test_commit_by_node_leader_only(root: Path) -> None:
    leader, other = _level(root, rank=0, leader=True), _level(root, rank=1, leader=False)
    leader.prepare()
    _write(leader, 2)
    _write(other, 2)
    record = {"step": 2, "world": 2}
    other.commit(2, record)
    assert not other.is_committed(2)
    leader.commit(2, record)
    assert other.is_committed(2) and leader.is_committed(2)
    assert other.record_world(2) == 2


def test_commit_keeps_existing_record(root: Path) -> None:
    level = _level(root)
    _write(level, 3)
    level.record_commit(3, {"step": 3, "world": 8, "by": "coordinator"})
    level.commit(3, {"step": 3, "world": 8, "by": "leader"})
    assert json.loads((root / "step-3" / COMMITTED).read_text())["by"] == "coordinator"


def test_discard_drops_only_own_tentative_shard(root: Path) -> None:
    r0, r1 = _level(root, rank=0), _level(root, rank=1, leader=False)
    _write(r0, 6)
    _write(r1, 6)
    r1.discard(6)
    assert not r1.shard_path(6).exists()
    assert r0.shard_path(6).exists()
    assert r1.inventory() == {6: {"committed": False, "have": False}}
    assert r0.inventory() == {6: {"committed": False, "have": True}}
    r1.discard(6)                               # idempotent
    r1.discard(99)


def test_open_shard_missing_and_identity(root: Path) -> None:
    level = _level(root, rank=2)
    with pytest.raises(CorruptCheckpointError, match="missing") as info:
        level.open_shard(1)
    assert info.value.rank == 2 and info.value.step == 1 and info.value.level == "local"
    _write(level, 1)
    # someone else's shard under this rank's name: rejected on identity
    os.replace(level.shard_path(1), _level(root, rank=3).shard_path(1))
    with pytest.raises(CorruptCheckpointError, match="shard has rank 2, expected 3"):
        _level(root, rank=3).open_shard(1)


def test_record_world_absent_or_unreadable(root: Path) -> None:
    level = _level(root)
    assert level.record_world(1) is None
    _write(level, 1)
    assert level.record_world(1) is None
    (root / "step-1" / COMMITTED).write_text("{not json")
    assert level.record_world(1) is None
    (root / "step-1" / COMMITTED).write_text('{"step": 1}')
    assert level.record_world(1) is None
    (root / "step-1" / COMMITTED).write_text('{"world": "x"}')
    assert level.record_world(1) is None
    (root / "step-1" / COMMITTED).write_text('{"world": 16}')
    assert level.record_world(1) == 16


def test_steps_ignores_foreign_names(root: Path) -> None:
    level = _level(root)
    level.prepare()
    for name in ("step-3", "step-10", "step-x", "step-", "stepp-4", "tmp"):
        (root / name).mkdir()
    (root / "step-7").write_text("")            # a file named like a step: still listed
    assert level.steps() == [3, 7, 10]
    assert _level(root.parent / "absent").steps() == []


# -------------------------------------------------------------- retention
def test_retain_removes_only_unkept_steps_on_leader(root: Path) -> None:
    leader, follower = _level(root, rank=0), _level(root, rank=1, leader=False)
    leader.prepare()
    for step in (1, 2, 3, 4):
        _write(leader, step)
        _write(follower, step)
    for step in (1, 2, 3):
        _commit(leader, step)
    (root / "notes.txt").write_text("keep me")
    (root / "step-abc").mkdir()
    follower.retain({3, 4})
    assert leader.steps() == [1, 2, 3, 4]       # non-leader never deletes
    assert all(follower.shard_path(step).exists() for step in (1, 2, 3, 4))
    follower.release({3, 4})                    # before a write: only its own shards go
    for step in (1, 2):
        assert not follower.shard_path(step).exists() and leader.shard_path(step).exists()
    leader.retain({3, 4})
    assert leader.steps() == [3, 4]
    assert (root / "notes.txt").read_text() == "keep me"
    assert (root / "step-abc").is_dir()
    for step in (3, 4):                         # kept steps are intact
        assert _load(leader, step)["step"] == step
        assert _load(follower, step)["step"] == step
    assert leader.is_committed(3) and not leader.is_committed(4)
    leader.retain(set())
    assert leader.steps() == []


# ------------------------------------------------------------------ faults
def test_corrupt_fault_after_local_write(root: Path) -> None:
    level = _level(root, rank=1, spec="corrupt:rank=1:step=2:level=local")
    _write(level, 1)
    _write(level, 2, nbytes=4096)
    _load(level, 1)                             # step 1 untouched
    with pytest.raises(CorruptCheckpointError, match="rank-1.ftk"):
        _load(level, 2)
    _write(level, 3)                            # fired once only
    _load(level, 3)


# ------------------------------------------------------------------ ENOSPC
def _leftovers(step_dir: Path) -> list[str]:
    return sorted(p.name for p in step_dir.iterdir()) if step_dir.exists() else []


@pytest.mark.parametrize("fail_on_call", [1, 2, 3])
def test_enospc_leaves_nothing_partial(root: Path, monkeypatch: pytest.MonkeyPatch,
                                       fail_on_call: int) -> None:
    level = _level(root, rank=2)
    level.prepare()
    before = _write(level, 1, nbytes=1 << 16)
    _commit(level, 1)
    committed_bytes = level.shard_path(1).read_bytes()
    real_write = os.write
    calls = {"n": 0}

    def full_disk(fd: int, data: Any) -> int:
        calls["n"] += 1
        if calls["n"] >= fail_on_call:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    with monkeypatch.context() as m:
        m.setattr(slots, "MAX_SLOTS", 0)          # the plain-file path (slots: test_slots)
        m.setattr(os, "write", full_disk)
        with pytest.raises(OSError) as info:
            _write(level, 2, nbytes=1 << 16)
    assert info.value.errno == errno.ENOSPC
    assert calls["n"] == fail_on_call
    leftovers = _leftovers(root / "step-2")
    assert not [n for n in leftovers if n.startswith("rank-")]
    assert not [n for n in leftovers if n.endswith(".tmp")]
    assert leftovers == []
    assert level.inventory()[2] == {"committed": False, "have": False}
    # the previous committed step is intact and verifiable
    assert level.inventory()[1] == {"committed": True, "have": True}
    assert level.shard_path(1).read_bytes() == committed_bytes
    assert torch.equal(_load(level, 1)["w"], before["w"])


def test_enospc_rewriting_same_step_keeps_old_shard(root: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    level = _level(root)
    _write(level, 5, fill=1)
    good = level.shard_path(5).read_bytes()

    def full_disk(fd: int, data: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(slots, "MAX_SLOTS", 0)       # the plain-file path
    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError):
        _write(level, 5, fill=2)
    monkeypatch.undo()
    assert level.shard_path(5).read_bytes() == good
    assert _leftovers(root / "step-5") == ["rank-0.ftk"]


def test_enospc_in_commit_record_leaves_no_temp(root: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    level = _level(root)
    _write(level, 1)

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        level.record_commit(1, {"step": 1, "world": WORLD})
    monkeypatch.undo()
    assert not level.is_committed(1)
    assert _leftovers(root / "step-1") == ["rank-0.ftk"]


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs",
                               str(mnt)], check=False, capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        proc = subprocess.run(["umount", str(mnt)], check=False, capture_output=True,
                              text=True, timeout=30)
        if proc.returncode != 0:          # still busy: detach it, and say why
            subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=30)
            pytest.fail(f"umount {mnt}: {proc.stderr.strip()} (a file left open?)")


def test_full_tmpfs_gives_enospc_and_keeps_previous(tiny_tmpfs: Path) -> None:
    level = _level(tiny_tmpfs / "job" / "node-0", rank=0)
    try:
        _fill_and_recover(level)
    finally:
        level.close()                   # its mapped slots would keep the tmpfs busy


def _fill_and_recover(level: LocalLevel) -> None:
    level.prepare()
    before = _write(level, 1, nbytes=16 * 1024)
    _commit(level, 1)
    with pytest.raises(OSError) as info:
        _write(level, 2, nbytes=128 * 1024)     # larger than the whole filesystem
    assert info.value.errno == errno.ENOSPC
    assert _leftovers(level.step_dir(2)) == []
    assert torch.equal(_load(level, 1)["w"], before["w"])
    assert level.inventory() == {1: {"committed": True, "have": True},
                                 2: {"committed": False, "have": False}}
    # space was given back: a shard that fits can still be written
    _write(level, 3, nbytes=16 * 1024)
    assert _load(level, 3)["step"] == 3


def test_write_record_is_atomic_json(tmp_path: Path) -> None:
    path = tmp_path / "REC"
    write_record(path, {"a": 1})
    write_record(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert _mode(path) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["REC"]


def test_commit_record_that_fails_after_its_rename_does_not_survive(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directory fsync after the rename fails: the decision is not durable, the
    coordinator aborts the step, so no COMMITTED record may be left behind."""
    level = _level(root)
    _write(level, 1)
    calls = []

    def failing_dir_sync(path: Path) -> None:
        calls.append(path)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr("ftkit.fs.fsync_dir", failing_dir_sync)
    with pytest.raises(OSError):
        level.record_commit(1, {"step": 1, "world": WORLD})
    monkeypatch.undo()
    assert calls, "the record was never renamed into place"
    assert not level.is_committed(1)
    assert _leftovers(root / "step-1") == ["rank-0.ftk"]
