"""PFS level: committed steps flushed to HDF5; restore from it when node-local data is gone;
a crash mid-flush leaves an incomplete PFS step that restore ignores."""
from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path

import h5py
import pytest

from ftkit.jobdir.events import read_events
from tests.e2e.jobs import run_toy

LEVELS = "local:1,pfs:3"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("files", ["rank", "shared"])
def test_all_local_dirs_lost_restore_from_hdf5(tmp_path: Path, files: str,
                                               reference_digest: Callable[..., str]) -> None:
    """Flushes run on their own thread, one at a time: the kill at the start of step 8's flush
    comes after steps 2, 4 and 6 were flushed (step 8 is committed only node-locally). With
    ``FTKIT_PFS_FILES=shared`` every step is one ``ranks.h5``."""
    levels = "local:1,pfs:2"
    first = run_toy(tmp_path, steps=8, max_restarts=0, FTKIT_LEVELS=levels,
                    FTKIT_FAULTS="kill:rank=1:step=8:phase=flush", FTKIT_PFS_FILES=files)
    assert first.rc != 0
    flushed = [e["step"] for e in first.events() if e["event"] == "flush"]
    assert flushed == [2, 4, 6], first.events()
    shutil.rmtree(first.local)                      # every node's local directory is gone
    res = run_toy(tmp_path, steps=8, max_restarts=0, FTKIT_LEVELS=levels,
                  FTKIT_PFS_FILES=files)
    assert res.rc == 0, res.tail()
    assert res.starts[0]["step"] == 6
    assert "restored step 6 from the PFS level" in res.stderr, res.tail()
    restores = [e for e in res.events() if e["event"] == "restore" and e.get("level") == "pfs"]
    assert [e["step"] for e in restores] == [6]
    assert res.done["digest"] == reference_digest(4, 8)
    with h5py.File(res.pfs / "e2e" / "step-6" / "ftkit.h5", "r") as h5:
        assert h5.attrs["world"] == 4 and h5.attrs["step"] == 6
        assert sorted(h5["rank"]) == ["0", "1", "2", "3"]
        assert h5["rank/2/model/0.weight"].shape == (64, 16)
    data = sorted(p.name for p in (res.pfs / "e2e" / "step-6").glob("*.h5"))
    assert data == (["ftkit.h5", "ranks.h5"] if files == "shared" else
                    ["ftkit.h5", "node-0.h5", "node-1.h5", "rank-0.h5", "rank-1.h5",
                     "rank-2.h5", "rank-3.h5"]), data


@pytest.mark.timeout(600)
def test_crash_in_the_early_write_leaves_the_committed_pfs_step(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """Rank 1 is killed by its early PFS write of step 6 (fault phase ``flush-early``, on the
    early write's thread while the training thread captures step 6 or runs its protocol;
    sync checkpoints: the flush of step 3 has ended, so the early write runs). The PFS keeps
    committed step 3; step 6 has no PFS ``COMMITTED`` and no rank file of rank 1 (its
    half-written file is a temp in ``.early`` that nothing names, as are those of the other
    ranks, which the launcher killed in their early writes). With every node-local
    directory gone, the relaunch removes the stale temp (rank 0, as its Checkpointer
    starts), restores step 3 from the PFS and ends bit-exact; no temp is left."""
    env = {"FTKIT_LEVELS": LEVELS, "FTKIT_ASYNC": "0"}
    first = run_toy(tmp_path, steps=8, max_restarts=0,
                    FTKIT_FAULTS="kill:rank=1:step=6:phase=flush-early", **env)
    assert first.rc != 0 and "rank 1 killed by SIGKILL" in first.stdout, first.tail()
    job = first.pfs / "e2e"
    assert (job / "step-3" / "COMMITTED").is_file()
    assert not (job / "step-6" / "COMMITTED").exists()
    assert not (job / "step-6" / "rank-1.h5").exists()
    stale = sorted(p.name for p in (job / ".early").iterdir())   # the launcher killed the
    assert any(n.startswith(".rank-1.h5.") for n in stale), stale  # others mid-write too
    assert all(re.fullmatch(r"\.rank-[0-3]\.h5\..+\.tmp", n) for n in stale), stale
    shutil.rmtree(first.local)
    res = run_toy(tmp_path, steps=8, max_restarts=0, **env)
    assert res.rc == 0, res.tail()
    assert res.starts[0]["step"] == 3, res.tail()
    assert res.done["digest"] == reference_digest(4, 8)
    assert (job / "step-6" / "COMMITTED").is_file()
    assert sorted((job / ".early").iterdir()) == []


@pytest.mark.timeout(600)
def test_crash_during_flush_leaves_incomplete_step(tmp_path: Path,
                                                   reference_digest: Callable[..., str]) -> None:
    first = run_toy(tmp_path, steps=8, max_restarts=0, FTKIT_LEVELS=LEVELS,
                    FTKIT_FAULTS="kill:rank=1:step=6:phase=flush")
    assert first.rc != 0
    step6 = first.pfs / "e2e" / "step-6"
    assert step6.is_dir() and not (step6 / "COMMITTED").exists()
    assert (first.pfs / "e2e" / "step-3" / "COMMITTED").is_file()
    shutil.rmtree(first.local)
    res = run_toy(tmp_path, steps=8, max_restarts=0, FTKIT_LEVELS=LEVELS)
    assert res.rc == 0, res.tail()
    assert res.starts[0]["step"] == 3, res.tail()
    assert res.done["digest"] == reference_digest(4, 8)


def _loss_at(res: object, step: int) -> float:
    lines = [r for r in res.json_lines()  # type: ignore[attr-defined]
             if r.get("event") == "step" and r["step"] == step]
    assert lines, res.tail()  # type: ignore[attr-defined]
    return float(lines[-1]["loss"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("n,rpn", [(2, 1), (8, 2)])
def test_restore_on_another_dp_size(n: int, rpn: int, tmp_path: Path) -> None:
    """A 4-rank (dp=4) checkpoint restored from HDF5 on 2 and on 8 ranks: each new rank
    loads the replicated model and optimizer state by name (resharded: the toy's optimizer
    state is keyed by its parameters) and rank dp_idx % 4's RNG state, the loader (global position) re-splits the same global
    batch, and the first step after restore has the loss the 4-rank job has at that step.
    Dropout is off: with it each rank's RNG stream (and so the mask) depends on the layout.
    Tolerance 1e-6 relative: only the order of the float sums differs."""
    no_dropout = ("--dropout", "0")
    (tmp_path / "saved").mkdir()
    saved = run_toy(tmp_path / "saved", steps=6, max_restarts=0, FTKIT_LEVELS=LEVELS,
                    extra=no_dropout)
    assert saved.rc == 0, saved.tail()
    original = run_toy(tmp_path / "saved", steps=7, max_restarts=0, FTKIT_LEVELS=LEVELS,
                       extra=no_dropout)
    assert original.starts[0]["step"] == 6
    moved = tmp_path / "moved"                     # a new allocation: only the PFS survives
    shutil.copytree(tmp_path / "saved" / "pfs", moved / "pfs")
    shutil.rmtree(moved / "pfs" / "e2e" / "step-7", ignore_errors=True)
    res = run_toy(moved, n=n, ranks_per_node=rpn, steps=7, max_restarts=0,
                  FTKIT_LEVELS=LEVELS, extra=no_dropout)
    assert res.rc == 0, res.tail()
    assert res.starts[0]["step"] == 6
    assert _loss_at(res, 7) == pytest.approx(_loss_at(original, 7), rel=1e-6)
    said = (f"resharded from the saved shards: 4 ranks (dp4 tp1 pp1) -> {n} ranks "
            f"(dp{n} tp1 pp1)")
    assert said in res.stderr, res.tail()
    [event] = [e for e in read_events(moved / "pfs" / "e2e" / "events.jsonl")
               if e["event"] == "reshard"]
    assert (event["step"], event["saved"]["world"], event["now"]["dp"]) == (6, 4, n), event


@pytest.mark.timeout(600)
def test_newer_pfs_step_wins_over_older_local_step(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """Local step 6 of rank 1 is corrupted, so the local levels can only offer step 5; the
    PFS holds step 6 intact: restore takes the newest, step 6, from the PFS."""
    from ftkit.faults import flip_byte
    first = run_toy(tmp_path, steps=6, max_restarts=0, FTKIT_LEVELS=LEVELS)
    assert first.rc == 0, first.tail()
    flip_byte(first.local / "node-0" / "step-6" / "rank-1.ftk")
    res = run_toy(tmp_path, steps=8, max_restarts=0, FTKIT_LEVELS=LEVELS)
    assert res.rc == 0, res.tail()
    assert res.starts[0]["step"] == 6
    assert "restored step 6 from the PFS level" in res.stderr, res.tail()
    assert res.done["digest"] == reference_digest(4, 8)


@pytest.mark.timeout(900)
def test_reshard_in_place_keeps_local_retention(tmp_path: Path) -> None:
    """Saved on 4 ranks (local steps 6 and 7, PFS step 6), continued on 2 ranks in the same
    directories: restore reshards PFS step 6; the old world's newer local step 7 is parked,
    not deleted, until the new world commits step 7; afterwards retention works as usual
    (only the newest versions stay, nothing of the old world is left)."""
    saved = run_toy(tmp_path, steps=7, max_restarts=0, FTKIT_LEVELS=LEVELS)
    assert saved.rc == 0, saved.tail()
    # as if the job had been killed before close() flushed its final step 7 to the PFS
    shutil.rmtree(saved.pfs / "e2e" / "step-7")
    res = run_toy(tmp_path, n=2, ranks_per_node=1, steps=10, max_restarts=0,
                  FTKIT_LEVELS=LEVELS)
    assert res.rc == 0, res.tail()
    assert res.starts[0]["step"] == 6
    assert "parked as parked-step-7" in res.stderr, res.tail()
    for i, node in enumerate(("node-0", "node-1")):
        left = sorted(p.name for p in (res.local / node).iterdir() if p.name != "LOCK")
        assert left == ["slots", "step-10", "step-9"], (node, left)
        owners = {p.name.split(".")[0] for p in (res.local / node / "slots").iterdir()}
        assert owners == {f"rank-{i}"}, (node, owners)   # the old world's slots pruned
        for step_dir in (res.local / node).glob("*step-*"):
            record = (step_dir / "COMMITTED").read_text()
            assert '"world": 2' in record, (step_dir, record)


@pytest.mark.timeout(600)
def test_default_backpressure_never_loses_the_newest_step(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """The default policy (``FTKIT_PFS_BACKPRESSURE=delay``) with a PFS step due at every
    step of the toy, whose steps take a few ms while a flush takes ~0.1 s: which steps are
    delayed or skipped depends on timing, but every due step is flushed or skipped (never
    lost silently), every skip names the newer step that superseded it, a delayed step is
    flushed later unless skipped, the last step reaches the PFS at close, and the run is
    bit-exact. The PFS then restores that last step."""
    steps = 12
    res = run_toy(tmp_path, steps=steps, max_restarts=0, FTKIT_LEVELS="local:1,pfs:1",
                  FTKIT_PFS_BACKPRESSURE="delay", FTKIT_PFS_KEEP="20")
    assert res.rc == 0, res.tail()
    assert res.done["digest"] == reference_digest(4, steps)
    events = res.events()
    flushed = [e["step"] for e in events if e["event"] == "flush"]
    delayed = [e["step"] for e in events if e["event"] == "flush-delayed"]
    skipped = {e["step"]: e["superseded_by"] for e in events if e["event"] == "flush-skipped"}
    assert sorted(flushed + list(skipped)) == list(range(1, steps + 1)), events
    assert flushed == sorted(flushed) and flushed[-1] == steps, flushed
    assert set(skipped) <= set(delayed) and all(s < n for s, n in skipped.items()), skipped
    assert set(delayed) - set(skipped) <= set(flushed)
    committed = sorted(int(p.parent.name[5:]) for p in (res.pfs / "e2e").glob("step-*/COMMITTED"))
    assert committed == flushed, (committed, flushed)
    shutil.rmtree(res.local)
    again = run_toy(tmp_path, steps=steps + 2, max_restarts=0, FTKIT_LEVELS="local:1,pfs:1")
    assert again.rc == 0, again.tail()
    assert again.starts[0]["step"] == steps, again.tail()
    assert again.done["digest"] == reference_digest(4, steps + 2)
