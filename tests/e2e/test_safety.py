"""Safety contracts of restore: committed checkpoints are never deleted or silently replaced.

* A checkpoint that cannot be used in this launch (another rank->node layout, another run's,
  a state of another shape) stops the job at once: ``ftkit run`` exits 3 with one attempt
  line saying "not retried" and the error class, stderr says why and how to start over
  (``--fresh``), and every checkpoint file is left exactly as it was.
* A restore from the PFS level completes the bookkeeping of the node-local levels, so the
  job can commit the step numbers that follow (the newer, unusable local steps do not block
  them) and finishes within its restarts.
* A PFS flush failure is agreed: every rank logs the same failure once, none raises it, and
  training goes on without a relaunch.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.jobs import Result, run_toy, tree_digests

NOT_RETRIED = 3          # ftkit run's exit status for an error a relaunch would hit again


def _snapshot(*roots: Path) -> tuple[dict[str, str], dict[Path, bytes]]:
    """Checkpoint files under ``roots`` ({path: sha256}) and the event logs' bytes.

    ``events.jsonl`` is append-only (checked as a prefix); the launcher's dot files at the
    job's root (completion markers, stop request) are bookkeeping of one launch, not
    checkpoints."""
    files: dict[str, str] = {}
    logs: dict[Path, bytes] = {}
    for root in roots:
        for rel, digest in tree_digests(root).items():
            path = root / rel
            if path.name == "events.jsonl":
                logs[path] = path.read_bytes()
            elif not path.name.startswith("."):
                files[str(path)] = digest
    return files, logs


def _assert_untouched(before: tuple[dict[str, str], dict[Path, bytes]], *roots: Path) -> None:
    files, logs = before
    now = _snapshot(*roots)[0]
    changed = sorted(p for p, d in files.items() if now.get(p) != d)
    assert not changed, f"checkpoint files deleted or changed: {changed}"
    for path, old in logs.items():
        assert path.read_bytes().startswith(old), f"{path} was rewritten, not appended to"


def _assert_not_retried(res: Result, error: str) -> None:
    """The job failed once with ``error`` and ``ftkit run`` did not relaunch it."""
    assert res.rc == NOT_RETRIED, (res.rc, res.tail())
    lines = res.attempt_lines()
    assert len(lines) == 1, (lines, res.tail())
    assert "not retried" in lines[0] and error in lines[0], (lines, res.tail())
    assert [s["attempt"] for s in res.starts] == [], res.starts     # never started training


# --------------------------------------------------------------------------- layout
@pytest.mark.timeout(180)
def test_other_node_layout_refused_and_kept_then_fresh_start(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """Steps 1-3 saved by 4 ranks on 2 nodes, relaunched on 4 nodes (1 rank each): a rank
    reads only its own node's directory, so the shards are not where their ranks now run.
    Restore must refuse without deleting anything; ``--fresh`` then starts over."""
    levels = "local:1,partner:1"
    first = run_toy(tmp_path, steps=3, max_restarts=0, FTKIT_LEVELS=levels)
    assert first.rc == 0, first.tail()
    roots = (tmp_path / "local", tmp_path / "pfs")
    before = _snapshot(*roots)
    assert any("step-3" in p for p in before[0]), before

    res = run_toy(tmp_path, steps=6, ranks_per_node=1, max_restarts=2, FTKIT_LEVELS=levels)
    _assert_not_retried(res, "UnrecoverableError")
    assert "node" in res.stderr and "step 3" in res.stderr, res.tail()
    assert "--fresh" in res.stderr, res.tail()
    _assert_untouched(before, *roots)

    fresh = run_toy(tmp_path, steps=3, ranks_per_node=1, max_restarts=0, run_args=("--fresh",),
                    FTKIT_LEVELS=levels)
    assert fresh.rc == 0, fresh.tail()
    assert [s["step"] for s in fresh.starts] == [0], fresh.starts
    assert fresh.done["digest"] == reference_digest(4, 3, ranks_per_node=1), fresh.tail()


# ---------------------------------------------------------------- restore from PFS
@pytest.mark.timeout(240)
def test_restore_from_pfs_then_continue_within_restarts(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """``local:1,pfs:2``, synchronous (so the flush of step 6 is complete when ``save(6)``
    returns). Node 1 is lost as step 8 is captured, after step 7 was committed: node 0 still
    holds its committed steps 6 and 7, node 1 holds nothing, no redundancy level covers them.
    The relaunch must restore step 6 from the PFS and then commit step 7 again although node
    0's directory holds a (now unusable) commit of step 7, and end bit-exact with the
    failure-free run after one relaunch (before the fix, ``save(7)`` was refused on every
    attempt: "already holds committed step 7")."""
    res = run_toy(tmp_path, steps=8, max_restarts=2, FTKIT_LEVELS="local:1,pfs:2",
                  FTKIT_ASYNC="0", FTKIT_FAULTS="node:rank=2:step=8:phase=capture")
    assert res.rc == 0, res.tail()
    assert res.committed(0)[-1] == 7, res.events()
    assert [e["step"] for e in res.events() if e["event"] == "flush"
            and e.get("attempt") == 0] == [2, 4, 6], res.events()
    assert [s["step"] for s in res.starts] == [0, 6], (res.starts, res.tail())
    pfs = [e for e in res.events() if e["event"] == "restore" and e.get("level") == "pfs"]
    assert [(e["attempt"], e["step"]) for e in pfs] == [(1, 6)], res.events()
    lines = res.attempt_lines()
    assert len(lines) == 2 and "succeeded" in lines[1], (lines, res.tail())
    assert "already holds committed step" not in res.stderr, res.tail()
    assert res.committed(1) == [7, 8], res.events()
    assert res.done["digest"] == reference_digest(4, 8), res.tail()


@pytest.mark.timeout(240)
def test_damaged_local_steps_restore_from_pfs(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """``local:1,pfs:2``. Rank 1's node-local shards of steps 6 and 7 are damaged as they are
    written (both commit: no redundancy level re-reads them before the vote); rank 0 dies as
    step 8 is captured. The PFS copy of step 6 is made from the damaged shard (or not finished
    yet when rank 0 dies), so the newest intact PFS step is 4 (6 only if a flush verified and
    repaired nothing; accepted too). The relaunch skips the damaged steps 7 and 6, restores
    from the PFS, commits steps 5.. again and ends bit-exact after one relaunch."""
    spec = ("corrupt:rank=1:step=6:level=local;corrupt:rank=1:step=7:level=local;"
            "kill:rank=0:step=8:phase=capture")
    res = run_toy(tmp_path, steps=8, max_restarts=2, FTKIT_LEVELS="local:1,pfs:2",
                  FTKIT_FAULTS=spec)
    assert res.rc == 0, res.tail()
    skipped = [e["step"] for e in res.events() if e["event"] == "restore-skip"]
    assert skipped == [7, 6], (res.events(), res.tail())      # rank 1's shards are damaged
    pfs = [e for e in res.events() if e["event"] == "restore" and e.get("level") == "pfs"]
    assert len(pfs) == 1 and pfs[0]["attempt"] == 1, (res.events(), res.tail())
    resumed = res.starts[1]["step"]
    assert pfs[0]["step"] == resumed and resumed in (4, 6), (resumed, res.events())
    lines = res.attempt_lines()
    assert len(lines) == 2 and "succeeded" in lines[1], (lines, res.tail())
    assert res.done["digest"] == reference_digest(4, 8), res.tail()


# ------------------------------------------------------------------- another run
@pytest.mark.timeout(180)
def test_another_runs_local_checkpoint_refused(tmp_path: Path) -> None:
    """Job "e2e" ran in directory A (its PFS directory A/pfs records the run). A new run of
    job "e2e" with the same node-local directory but an empty PFS directory B/pfs is another
    run: its restore must not resume, nor overwrite, A's node-local steps."""
    local = tmp_path / "shared-local"
    a, b = tmp_path / "A", tmp_path / "B"
    a.mkdir()
    b.mkdir()
    first = run_toy(a, steps=3, max_restarts=0, FTKIT_LOCAL_DIR=str(local),
                    FTKIT_PFS_DIR=str(a / "pfs"))
    assert first.rc == 0, first.tail()
    before = _snapshot(local)
    assert before[0], "the first run left no node-local files"

    res = run_toy(b, steps=3, max_restarts=2, FTKIT_LOCAL_DIR=str(local),
                  FTKIT_PFS_DIR=str(b / "pfs"))
    _assert_not_retried(res, "UnrecoverableError")
    assert "another run" in res.stderr, res.tail()
    _assert_untouched(before, local)


# ------------------------------------------------------------------ state shape
@pytest.mark.timeout(180)
def test_state_of_another_shape_refused(tmp_path: Path) -> None:
    """Steps saved with ``--hidden 64``, relaunched with ``--hidden 32``: resuming would load
    a checkpoint into another model. Refused, naming the tensor and both shapes."""
    first = run_toy(tmp_path, steps=3, max_restarts=0)
    assert first.rc == 0, first.tail()
    roots = (tmp_path / "local", tmp_path / "pfs")
    before = _snapshot(*roots)

    res = run_toy(tmp_path, steps=6, max_restarts=2, extra=("--hidden", "32"))
    _assert_not_retried(res, "StateMismatchError")
    assert "StateMismatchError" in res.stderr, res.tail()
    assert "0.weight" in res.stderr, res.tail()       # model.0.weight: Linear(16, hidden)
    assert "64, 16" in res.stderr and "32, 16" in res.stderr, res.tail()
    _assert_untouched(before, *roots)


# ------------------------------------------------------------------- flush errors
@pytest.mark.timeout(240)
def test_flush_error_is_agreed_logged_once_per_rank_and_not_raised(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """A fault raised in rank 3's PFS flush of step 3 (``local:1,pfs:3``, log level INFO):
    every rank logs the same agreed failure exactly once (rank 0 at WARNING, the others at
    INFO), naming the step and rank 3's error; no rank raises a CheckpointError; the job
    completes in its first attempt, bit-exact; step 3 on the PFS stays incomplete and step 6
    is committed there."""
    res = run_toy(tmp_path, steps=8, max_restarts=2, FTKIT_LEVELS="local:1,pfs:3",
                  FTKIT_FAULTS="raise:rank=3:step=3:phase=flush", FTKIT_LOG_LEVEL="INFO")
    assert res.rc == 0, res.tail()
    lines = res.attempt_lines()
    assert len(lines) == 1 and "succeeded" in lines[0], (lines, res.tail())
    lines = res.stderr.splitlines()
    for rank in range(4):        # every rank learnt of the failure of rank 3's flush, once
        logged = [ln for ln in lines if ln.startswith(f"ftkit[rank {rank}@")
                  and "PFS flush of step 3 failed" in ln]
        assert len(logged) == 1 and "rank 3: InjectedFault" in logged[0], (rank, res.tail())
        assert (" WARNING " if rank == 0 else " INFO ") in logged[0], logged
    assert not [ln for ln in lines if ln.startswith("ftkit.errors.")], res.tail()
    assert not (res.pfs / "e2e" / "step-3" / "COMMITTED").exists()
    assert (res.pfs / "e2e" / "step-6" / "COMMITTED").is_file()
    assert res.done["digest"] == reference_digest(4, 8), res.tail()
