"""The PFS level never trusts an unchecked byte, end to end (real ``ftkit run`` jobs, 4 ranks on
2 virtual nodes): a corrupt node-local shard is never flushed; a PFS step whose metadata was
changed is skipped by restore; writing a step number again removes its old COMMITTED record
before any file of it is rewritten, so a crash never mixes two timelines."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import h5py
import pytest

from ftkit.cli.main import main
from tests.e2e.jobs import run_toy

LEVELS = "local:1,pfs:3"


@pytest.mark.timeout(900)
def test_corrupt_local_shard_is_never_copied_to_the_pfs(
        tmp_path: Path, reference_digest: Callable[..., str],
        capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1's committed local shard of step 6 has a flipped byte when step 6 is flushed: the
    flush fails on every rank (no COMMITTED; the incomplete step directory is removed), which is
    a warning and a ``flush-failed`` event, not an abort: training finishes on the node-local
    levels with the failure-free result. Before: the flipped bytes were copied into the PFS
    under the old checksum, step 6 was committed on the PFS, and `ftkit verify` failed on it."""
    res = run_toy(tmp_path, steps=6, max_restarts=1, FTKIT_LEVELS=LEVELS,
                  FTKIT_FAULTS="corrupt:rank=1:step=6:level=local")
    assert res.rc == 0, res.tail()
    assert len(res.attempt_lines()) == 1, res.tail()
    assert "is not copied to the PFS" in res.stderr, res.tail()
    assert [e["step"] for e in res.events() if e["event"] == "flush"] == [3]
    assert [e["step"] for e in res.events() if e["event"] == "flush-failed"] == [6]
    assert not (res.pfs / "e2e" / "step-6").exists()
    assert not list((res.pfs / "e2e").rglob("*.tmp"))
    assert res.done["digest"] == reference_digest(4, 6)
    assert main(["verify", str(res.pfs / "e2e")]) == 0, capsys.readouterr().out


def _tamper_tree(node_file: Path, rank: int) -> None:
    """Rewrite the data loader's position in ``rank``'s tree attribute (no reseal)."""
    with h5py.File(node_file, "r+") as h5:
        grp = h5[f"rank/{rank}"]
        text = json.dumps(json.loads(grp.attrs["tree"]))
        pos = '["pos", {"t": "v", "v": '
        assert pos in text, text
        grp.attrs["tree"] = text.replace(pos, pos + "9")


@pytest.mark.timeout(1200)
def test_damaged_pfs_step_skipped_and_rewritten_step_retracts_commit_first(
        tmp_path: Path, reference_digest: Callable[..., str],
        capsys: pytest.CaptureFixture[str]) -> None:
    """1. A job commits PFS steps 3 and 6 (COMMITTED carries run and nodes). 2. Rank 0's tree
    in step 6 is edited (the loader position) and every local directory is lost: restore
    skips step 6 (restore-skip: rank-0.h5 no longer matches the digest in COMMITTED, caught
    before libhdf5 opens it) and loads step 3 — before: it loaded the
    edited state and started at 6. 3. Training saves step 6 again; its flush is killed: the
    old COMMITTED of step 6 is already gone — before: it stayed, over node files being
    replaced. 4. A relaunch finishes with the failure-free digest."""
    first = run_toy(tmp_path, steps=6, max_restarts=0, FTKIT_LEVELS=LEVELS)
    assert first.rc == 0, first.tail()
    step6 = first.pfs / "e2e" / "step-6"
    record = json.loads((step6 / "COMMITTED").read_text())
    assert record["step"] == 6 and record["nodes"] == [0, 0, 1, 1] and "run" in record
    with h5py.File(step6 / "ftkit.h5", "r") as h5:
        assert h5.attrs["format"] == "ftkit-hdf5-2" and "run" in h5.attrs
        assert "meta_checksum" in h5.attrs
    _tamper_tree(step6 / "node-0.h5", 0)        # through the node file's link: rank-0.h5
    shutil.rmtree(first.local)

    second = run_toy(tmp_path, steps=6, max_restarts=0, FTKIT_LEVELS=LEVELS,
                     FTKIT_FAULTS="kill:rank=1:step=6:phase=flush")
    assert second.rc != 0
    assert [s["step"] for s in second.starts] == [3], second.tail()
    skips = [e for e in second.events() if e["event"] == "restore-skip"
             and e.get("level") == "pfs"]
    assert [e["step"] for e in skips] == [6], skips
    assert "metadata digest mismatch" in skips[0]["reason"] or \
        "COMMITTED recorded" in skips[0]["reason"], skips
    assert "rank-0.h5" in skips[0]["reason"] and "\n" not in skips[0]["reason"]
    assert step6.is_dir() and not (step6 / "COMMITTED").exists()

    third = run_toy(tmp_path, steps=8, max_restarts=0, FTKIT_LEVELS=LEVELS)
    assert third.rc == 0, third.tail()
    assert [s["step"] for s in third.starts] == [6], third.tail()
    assert third.done["digest"] == reference_digest(4, 8)
    assert main(["verify", str(first.pfs / "e2e"), "--step", "3"]) == 0
    capsys.readouterr()
