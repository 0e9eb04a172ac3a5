"""A full, filling or vanished parallel file system degrades a job, it never kills it or costs
a restart (docs/protocol.md, "A failed flush is a warning"). Real small tmpfs mounts (root
only; skipped with the reason elsewhere), 4 ranks on 2 virtual nodes, the toy example.

Before the fix, a real ENOSPC inside libhdf5 surfaced later from an h5py destructor on the
main thread and aborted the job on every relaunch, leaving ``.node-*.h5.tmp`` temp files behind.
"""
from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.jobs import FTKIT, REPO, Result, run_example, run_toy, tree_digests
from tests.mounts import fill, free_bytes, hidden, tmpfs

LEVELS = "local:1,partner:1,pfs:2"
STEP_BYTES = 304 << 10          # one toy step on the PFS: four rank files, two node files
                                # (links only), index, COMMITTED (as tmpfs counts them)
_FAILED = re.compile(r"ftkit\[rank 0@\S+\] WARNING \S+: PFS flush of step (\d+) failed; (.*)")


def _failed_flushes(res: Result) -> dict[int, str]:
    """{step: line} of every PFS flush rank 0 reported as failed (the event log may be on
    the full file system too, so the log lines are the record)."""
    return {int(m.group(1)): m.group(2) for m in map(_FAILED.match, res.stderr.splitlines())
            if m}


def _pfs_committed(pfs: Path) -> list[int]:
    return sorted(int(p.parent.name[5:]) for p in (pfs / "e2e").glob("step-*/COMMITTED"))


def _one_bit_exact_attempt(res: Result, digest: str) -> None:
    """The job succeeded in its first attempt (no restart spent), nothing aborted or raised
    an ftkit error, and it ended with the failure-free run's ``digest``."""
    assert res.rc == 0, res.tail()
    lines = res.attempt_lines()
    assert len(lines) == 1 and "succeeded" in lines[0], (lines, res.tail())
    assert "uncaught exception" not in res.stderr and "ftkit: rank " not in res.stderr, res.tail()
    assert not [ln for ln in res.stderr.splitlines() if ln.startswith("ftkit.errors.")]
    assert res.done["digest"] == digest, res.tail()


@pytest.mark.timeout(300)
def test_full_pfs_from_the_start(tmp_path: Path,
                                 reference_digest: Callable[..., str]) -> None:
    """The PFS is full before the job starts (no run record, no event, no marker fits): every
    flush fails with ENOSPC and is agreed, no temp file stays, training goes on on the
    in-memory levels, and the job ends in its first attempt, bit-exact; the completion
    marker is the renamed placeholder."""
    with tmpfs(tmp_path / "pfs", "1m") as pfs:
        (pfs / "e2e").mkdir()
        fill(pfs)
        assert free_bytes(pfs) == 0
        res = run_toy(tmp_path, steps=8, max_restarts=2, FTKIT_LEVELS=LEVELS)
        _one_bit_exact_attempt(res, reference_digest(4, 8))
        failed = _failed_flushes(res)
        assert sorted(failed) == [2, 4, 6, 8], res.tail()
        assert all("No space left on device" in why for why in failed.values()), failed
        assert _pfs_committed(pfs) == []
        assert not list(pfs.rglob("*.tmp")), sorted(pfs.rglob("*"))
        marker = pfs / "e2e" / ".done-attempt-0"
        assert marker.is_file() and marker.stat().st_size == 0
        assert not list(pfs.rglob("*.pending"))
        assert "ftkit run: the job's completion record is empty (no room on the PFS" \
            in res.stdout, res.tail()


@pytest.mark.timeout(300)
def test_pfs_full_until_the_end_says_which_step_is_only_node_local(
        tmp_path: Path, reference_digest: Callable[..., str]) -> None:
    """The PFS fills up before the save of step 5 and stays full: the flushes of steps 6 and
    8 fail, the job ends in its first attempt, bit-exact, and ``ftkit run``'s last line says
    that step 8 is only in the node-local copies, where, and that step 4 is the newest on
    the PFS (the completion record was written over its placeholder's blanks)."""
    with tmpfs(tmp_path / "pfs", "4m") as pfs:
        res = run_example(tmp_path, REPO / "tests" / "e2e" / "toy_hooks.py", n=4,
                          args=("--steps", "8", "--seed", "1"), max_restarts=2, timeout=280,
                          env={"FTKIT_LEVELS": LEVELS, "FILL_AT": "5",
                               "FILL_BALLAST": str(pfs / "ballast")})
        _one_bit_exact_attempt(res, reference_digest(4, 8))
        assert sorted(_failed_flushes(res)) == [6, 8], res.tail()
        assert _pfs_committed(pfs)[-1] == 4
        last = res.stdout.strip().splitlines()[-1]
        assert last.startswith(f"ftkit run: step 8 of job e2e is only in the node-local "
                               f"copies under {tmp_path / 'local'} (the PFS flush of step 8 "
                               f"failed: "), res.tail()
        assert "step 4 is the newest on the PFS" in last and "--resume e2e" in last


@pytest.mark.timeout(300)
def test_pfs_fills_up_mid_run_then_is_freed(tmp_path: Path,
                                            reference_digest: Callable[..., str]) -> None:
    """Room for two steps: the flushes of steps 2 and 4 commit, step 6's fails with ENOSPC
    (agreed, nothing left behind); rank 0 frees the file system before the save of step 9,
    and every flush from step 10 on commits again. One attempt, bit-exact, and every PFS
    step that committed verifies."""
    with tmpfs(tmp_path / "pfs", "4m") as pfs:
        ballast = fill(pfs, leave=2 * STEP_BYTES + (64 << 10))
        res = run_example(tmp_path, REPO / "tests" / "e2e" / "toy_hooks.py", n=4,
                          args=("--steps", "16", "--seed", "1"), max_restarts=2,
                          timeout=280, env={"FTKIT_LEVELS": LEVELS, "FREE_AT": "9",
                                            "FREE_BALLAST": str(ballast),
                                            # every committed step stays to be counted
                                            "FTKIT_PFS_KEEP": "8"})
        _one_bit_exact_attempt(res, reference_digest(4, 16))
        failed = _failed_flushes(res)
        committed = _pfs_committed(pfs)
        assert committed[:2] == [2, 4] and 6 in failed, (committed, failed, res.tail())
        assert "No space left on device" in failed[6], failed
        assert set(failed) <= {6, 8} and [s for s in committed if s > 8] == [10, 12, 14, 16]
        assert set(committed) | set(failed) == {2, 4, 6, 8, 10, 12, 14, 16}
        assert not list(pfs.rglob("*.tmp")), sorted(pfs.rglob("*"))
        for step in committed:
            ok = subprocess.run([*FTKIT, "verify", str(pfs / "e2e"), "--step", str(step)],
                                check=False, capture_output=True, text=True, timeout=120)
            assert ok.returncode == 0, (step, ok.stdout, ok.stderr)


@pytest.mark.timeout(400)
def test_vanished_pfs_is_refused_then_resumed(tmp_path: Path,
                                              reference_digest: Callable[..., str]) -> None:
    """Node 1 (ranks 2 and 3) dies with its local data in the flush of step 8 (``local:1,
    pfs:2``): only the PFS can restore it. With the PFS directory vanished (hidden under an
    empty mount) the relaunch stops at once with an error that is not retried, and changes
    no node-local file; when the PFS is back, the next launch restores PFS step 6 and ends
    bit-exact."""
    levels = "local:1,pfs:2"
    with tmpfs(tmp_path / "pfs", "16m") as pfs:
        first = run_toy(tmp_path, steps=8, max_restarts=0, FTKIT_LEVELS=levels,
                        FTKIT_FAULTS="node:rank=2:step=8:phase=flush")
        assert first.rc != 0
        assert _pfs_committed(pfs) == [4, 6], first.tail()     # FTKIT_PFS_KEEP=2
        before = tree_digests(first.local)
        with hidden(pfs, tmp_path / "empty"):
            gone = run_toy(tmp_path, steps=8, max_restarts=2, FTKIT_LEVELS=levels)
            assert gone.rc == 3, gone.tail()
            lines = gone.attempt_lines()
            assert len(lines) == 1 and "not retried" in lines[0], (lines, gone.tail())
        assert tree_digests(first.local) == before
        res = run_toy(tmp_path, steps=8, max_restarts=0, FTKIT_LEVELS=levels)
        assert res.rc == 0, res.tail()
        assert res.starts[0]["step"] == 6, res.tail()
        assert res.done["digest"] == reference_digest(4, 8), res.tail()
