"""ftkit.storage.slots through the node-local level: shards written into reused files and
published as hard links; a slot named by any step is never written; failures leave no name
and nothing committed changes; one write pass with the checksum riding on it."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ftkit import passes
from ftkit.capture.flatten import flatten
from ftkit.capture.staging import Stager
from ftkit.errors import CorruptCheckpointError
from ftkit.faults import Faults
from ftkit.storage import slots
from ftkit.storage.local import LocalLevel
from ftkit.storage.shard import Shard, write_shard

WORLD = 2
REPO = Path(__file__).resolve().parents[2]


def _level(root: Path, rank: int = 0) -> LocalLevel:
    level = LocalLevel(root, rank=rank, node_leader=True,
                       faults=Faults("", rank=rank, node=0, attempt=0))
    level.prepare()
    return level


def _parts(step: int, rank: int, n: int) -> tuple[dict[str, Any], Any, list[Any], Any]:
    state = {"w": torch.arange(n, dtype=torch.float32) * step, "b": np.full(5, step, np.int16),
             "e": torch.empty(0), "step": step}
    tree, leaves = flatten(state)
    meta = {"job": "unit", "step": step, "rank": rank, "world": WORLD}
    return meta, tree, leaves, Stager().capture(leaves)


def _write(level: LocalLevel, step: int, n: int = 1000) -> None:
    level.write_tentative(step, *_parts(step, level.rank, n))


def _commit(level: LocalLevel, step: int) -> None:
    record = {"step": step, "decision": "commit", "world": WORLD}
    level.record_commit(step, record)
    level.commit(step, record)


def _slot_files(level: LocalLevel) -> list[str]:
    return sorted(p.name for p in level.slots.dir.iterdir())


def _check(level: LocalLevel, step: int) -> None:
    level.check_shard(step, WORLD)                       # header, identity, every checksum
    with level.open_shard(step) as shard:
        w = np.frombuffer(shard.raw(0), dtype=np.float32)
    assert np.array_equal(w, np.arange(len(w), dtype=np.float32) * step)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "local" / "job" / "node-0"


def test_a_superseded_steps_slot_is_reused_in_place(root: Path) -> None:
    level = _level(root)
    for step in (1, 2):
        _write(level, step)
        _commit(level, step)
    first = os.stat(level.shard_path(1)).st_ino
    assert os.stat(level.shard_path(1)).st_nlink == 2          # the step's name + the slot
    level.retain({2})                                       # step 1 superseded: slot free
    _write(level, 3)
    assert os.stat(level.shard_path(3)).st_ino == first         # same file, overwritten
    assert _slot_files(level) == ["rank-0.0.slot", "rank-0.1.slot"]
    for step in (2, 3):
        _check(level, step)
    level.close()


def _reuse_a_truncated_slot(root: Path) -> None:
    """Step 1's shard (a slot) truncated behind the level's back, then superseded: the save
    that reuses its slot must not write through the old mapping past the file's end."""
    level = _level(root)
    for step in (1, 2):
        _write(level, step, n=1 << 16)
        _commit(level, step)
    os.truncate(level.shard_path(1), 4096)
    with pytest.raises(CorruptCheckpointError, match="rank-0.ftk"):
        level.check_shard(1, WORLD)                         # detected as damaged
    level.retain({2})                                       # the damaged slot is free again
    _write(level, 3, n=1 << 16)
    _commit(level, 3)
    for step in (2, 3):
        _check(level, step)
    level.close()


def test_a_truncated_slot_is_mapped_anew_not_written_past_its_end(root: Path) -> None:
    # in a process of its own: a SIGBUS must fail this test, not kill pytest
    code = ("import sys; from pathlib import Path; from tests.unit.test_slots import "
            "_reuse_a_truncated_slot as run; run(Path(sys.argv[1]))")
    child = subprocess.run([sys.executable, "-c", code, str(root)], cwd=REPO,
                           capture_output=True, text=True, timeout=120, check=False)
    died = f"the save into the truncated slot died: {child.returncode}"
    assert child.returncode == 0, (died, child.stderr[-3000:])


def test_a_slot_named_by_a_step_is_never_written(root: Path) -> None:
    level = _level(root)
    for step in (1, 2):
        _write(level, step)
        _commit(level, step)
    before = {s: level.shard_path(s).read_bytes() for s in (1, 2)}
    _write(level, 3)                                 # nothing retired: a third slot
    assert len(_slot_files(level)) == 3
    assert {s: level.shard_path(s).read_bytes() for s in (1, 2)} == before
    _check(level, 3)


def test_all_slots_in_use_falls_back_to_a_plain_file(root: Path) -> None:
    level = _level(root)
    for step in range(1, slots.MAX_SLOTS + 2):
        _write(level, step)
    assert len(_slot_files(level)) == slots.MAX_SLOTS
    last = level.shard_path(slots.MAX_SLOTS + 1)
    assert os.stat(last).st_nlink == 1
    _check(level, slots.MAX_SLOTS + 1)


def test_a_slot_shard_is_byte_identical_to_a_plain_one(root: Path, tmp_path: Path) -> None:
    """Also when the reused slot held a larger shard before (old bytes in the gaps)."""
    level = _level(root)
    _write(level, 1, n=5000)
    level.retain(set())                            # step 1 gone: its larger slot is free
    _write(level, 2, n=999)
    plain = tmp_path / "plain.ftk"
    write_shard(plain, *_parts(2, 0, 999))
    assert level.shard_path(2).read_bytes() == plain.read_bytes()
    assert _slot_files(level) == ["rank-0.0.slot"]


def test_a_failed_write_leaves_no_name_and_the_committed_step(root: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    level = _level(root)
    _write(level, 1)
    _commit(level, 1)
    _write(level, 2)
    _commit(level, 2)
    level.retain({2})
    committed = level.shard_path(2).read_bytes()
    calls = {"n": 0}
    real = slots.copy_hashed

    def dies_midway(dst: np.ndarray, src: np.ndarray) -> str:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.EIO, "simulated crash while copying")
        return real(dst, src)

    with monkeypatch.context() as m:
        m.setattr(slots, "copy_hashed", dies_midway)
        with pytest.raises(OSError):
            _write(level, 3)
    assert not level.shard_path(3).exists()
    assert not [p for p in level.step_dir(3).iterdir()]       # no temp name left either
    assert level.shard_path(2).read_bytes() == committed
    _write(level, 3)                                          # the half-written slot: reused
    _check(level, 3)
    assert len(_slot_files(level)) == 2


def test_a_full_disk_for_a_new_slot_leaves_nothing(root: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    level = _level(root)
    _write(level, 1)
    _commit(level, 1)

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(os, "posix_fallocate", full)
        with pytest.raises(OSError) as info:
            _write(level, 2)
    assert info.value.errno == errno.ENOSPC
    assert _slot_files(level) == ["rank-0.0.slot"]            # no stub of the new slot
    assert not level.shard_path(2).exists()
    _check(level, 1)


def test_a_local_write_is_one_pass(root: Path) -> None:
    level = _level(root)
    _write(level, 1, n=1 << 16)                # the first one creates the slot
    level.retain(set())
    args = _parts(2, 0, 1 << 16)
    state_bytes = sum(leaf.nbytes for leaf in args[2])
    before = passes.snapshot()
    level.write_tentative(2, *args)
    moved = passes.since(before)
    assert moved["write"] == state_bytes and moved["hash"] == 0 and moved["copy"] == 0
    with Shard.open(level.shard_path(2), rank=0, step=2) as shard:
        shard.verify()


# ------------------------------------------------------------ staging into a slot
def _reserve_and_stage(level: LocalLevel, step: int, state: dict[str, Any],
                       background: bool = False, defer: bool | None = None
                       ) -> tuple[Any, Any, list[Any], Any]:
    tree, leaves = flatten(state)
    meta = {"job": "unit", "step": step, "rank": level.rank, "world": WORLD}
    res = level.reserve(step, meta, tree, leaves)
    assert res is not None
    stager = Stager(background=background)
    later = background if defer is None else defer
    bufs, staging = stager.start(leaves, lambda leaf: later, step=step, into=res)
    assert staging.wait() is None
    assert stager.allocated_bytes == 0                 # no staging buffer for CPU tensors
    stager.close()
    return meta, tree, leaves, bufs


def test_cpu_tensors_are_staged_straight_into_the_slot(root: Path, tmp_path: Path) -> None:
    """One pass (the copy into the slot, hashed as it lands), no staging buffer; the
    published shard is byte for byte a plain write of the same state."""
    level = _level(root)
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "b": np.arange(7, dtype=np.int16),
             "t": torch.arange(12.).reshape(3, 4).t(), "e": torch.empty(0), "step": 4}
    before = passes.snapshot()
    meta, tree, leaves, bufs = _reserve_and_stage(level, 4, state)
    level.write_tentative(4, meta, tree, leaves, bufs)
    moved = passes.since(before)
    strided = state["t"].numel() * 4               # laid out by torch, then hashed
    assert moved["write"] == sum(lf.nbytes for lf in leaves) - strided
    assert moved["copy"] == strided and moved["hash"] == strided
    plain = tmp_path / "plain.ftk"
    ptree, pleaves = flatten(state)
    write_shard(plain, meta, ptree, pleaves, Stager().capture(pleaves))
    assert level.shard_path(4).read_bytes() == plain.read_bytes()
    assert os.stat(level.shard_path(4)).st_nlink == 2


def test_deferred_tensors_land_in_the_slot_from_the_worker(root: Path) -> None:
    level = _level(root)
    state = {"w": torch.arange(1 << 15, dtype=torch.float64), "step": 2}
    meta, tree, leaves, bufs = _reserve_and_stage(level, 2, state, background=True)
    level.write_tentative(2, meta, tree, leaves, bufs)
    level.check_shard(2, WORLD)
    with level.open_shard(2) as shard:
        assert np.array_equal(np.frombuffer(shard.raw(0), np.float64), state["w"].numpy())


def test_async_capture_copies_into_the_slot_and_the_write_hashes_in_place(root: Path
                                                                         ) -> None:
    """A background stager's own-thread copies (leaves it may not defer) go into the slot
    unhashed: the training loop waits for a plain copy; the write then hashes them where
    they are (copy 1 + hash 1, no write pass, no staging buffer) and the shard verifies."""
    level = _level(root)
    state = {"w": torch.arange(1 << 15, dtype=torch.float32), "step": 3}
    before = passes.snapshot()
    meta, tree, leaves, bufs = _reserve_and_stage(level, 3, state, background=True,
                                                  defer=False)
    staged = passes.since(before)
    nbytes = sum(lf.nbytes for lf in leaves)
    assert staged["copy"] == nbytes and not staged["hash"] and not staged["write"]
    level.write_tentative(3, meta, tree, leaves, bufs)
    moved = passes.since(before)
    assert moved["hash"] == nbytes and not moved["write"], moved
    level.check_shard(3, WORLD)
    with level.open_shard(3) as shard:
        assert np.array_equal(np.frombuffer(shard.raw(0), np.float32), state["w"].numpy())


def test_a_reservation_of_another_step_is_not_used(root: Path) -> None:
    """The write of a step finishes only the reservation made for it (same step, same
    header); otherwise the slot stays free and the shard is written from the buffers."""
    level = _level(root)
    state = {"w": torch.ones(100), "step": 1}
    tree, leaves = flatten(state)
    level.reserve(1, {"job": "unit", "step": 1, "rank": 0, "world": WORLD}, tree, leaves)
    _write(level, 2)
    _check(level, 2)
    assert not level.shard_path(1).exists()


def test_the_free_slots_of_ranks_no_longer_here_are_pruned(root: Path) -> None:
    """After a relaunch on another layout: the leader's retention removes the free slots
    of ranks that are not on this node any more, not a slot a step still names."""
    here, gone = _level(root, rank=0), _level(root, rank=5)
    for step in (1, 2):
        for level in (here, gone):
            _write(level, step)
    here.node_ranks = {0}
    here.retain({2})                                  # step 1 gone: rank 5's slot free
    names = _slot_files(here)
    assert "rank-5.0.slot" not in names and "rank-5.1.slot" in names   # step 2 names it
    assert {"rank-0.0.slot", "rank-0.1.slot"} <= set(names)
    here.retain(set())
    assert [n for n in _slot_files(here) if n.startswith("rank-5")] == []
    assert len([n for n in _slot_files(here) if n.startswith("rank-0")]) == 2


def test_a_shard_is_sent_from_the_mapping_its_write_made(root: Path, tmp_path: Path) -> None:
    """``view_of`` gives the bytes of a shard this rank wrote into a slot (read-only, no new
    mapping); a file that is not one of its mapped slots (a plain copy with the same bytes,
    a missing file) gets None."""
    level = _level(root)
    _write(level, 1)
    path = level.shard_path(1)
    view = level.slots.view_of(path)
    assert view is not None and not view.flags.writeable
    assert view.tobytes() == path.read_bytes()
    plain = tmp_path / "plain.ftk"
    plain.write_bytes(path.read_bytes())
    assert level.slots.view_of(plain) is None
    assert level.slots.view_of(tmp_path / "missing.ftk") is None
    level.close()


def test_a_claimed_slot_is_published_only_while_free(root: Path) -> None:
    """A partner copy's slot (``rank-<r>.partner-<q>.<k>.slot``): claimed at the received
    file's size, published as a hard link; once a step names it, it is never claimed
    again, and publishing a slot someone linked meanwhile raises with the target untouched."""
    level = _level(root)
    level.ensure_step_dir(1)
    held = slots.Slots(root, 0, of="partner-3")
    claimed = held.claim(4096)
    assert claimed is not None
    slot, view = claimed
    assert slot.name == "rank-0.partner-3.0.slot" and len(view) == 4096
    view[:] = 7
    target = level.step_dir(1) / "partner-3.ftk"
    held.publish(slot, target)
    assert target.read_bytes() == b"\x07" * 4096 and os.stat(target).st_ino == os.stat(slot).st_ino
    again = held.claim(4096)
    assert again is not None and again[0] != slot           # the first is named by step 1
    os.link(again[0], root / "stolen")
    other = level.step_dir(1) / "partner-3b.ftk"
    with pytest.raises(OSError, match="not published"):
        held.publish(again[0], other)
    assert not other.exists()
    held.close()
    level.close()
