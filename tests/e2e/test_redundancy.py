"""Node loss on 8 ranks / 4 virtual nodes: rebuild from partner, XOR and RS; clear fallback
when a step cannot be rebuilt; corrupted copies and parity are detected and not used."""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.jobs import Result, run_toy

N, STEPS, FAULT_STEP = 8, 8, 5


def _run(tmp: Path, levels: str, faults: str = "", **kw: object) -> Result:
    return run_toy(tmp, n=N, steps=STEPS, FTKIT_LEVELS=levels, FTKIT_FAULTS=faults,
                   **kw)  # type: ignore[arg-type]


def _rebuilds(res: Result) -> list[dict]:
    return [e for e in res.events() if e["event"] == "rebuild"]


def _wipe_node(res: Result, node: int) -> None:
    """What a lost node looks like to the relaunched job: its local directory is gone."""
    shutil.rmtree(res.local / f"node-{node}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("phase,resume", [
    pytest.param("write-local", 4, marks=pytest.mark.slow), ("encode", 4),
    pytest.param("commit", 5, marks=pytest.mark.slow), ("between", 4)])
def test_lost_node_rebuilt_from_partner(phase: str, resume: int, tmp_path: Path,
                                        reference_digest: Callable[..., str]) -> None:
    res = _run(tmp_path, "local:1,partner:1", f"node:rank=2:step={FAULT_STEP}:phase={phase}")
    assert res.rc == 0, res.tail()
    assert [s["step"] for s in res.starts] == [0, resume], res.tail()
    [rb] = _rebuilds(res)
    assert rb["step"] == resume and rb["nodes"] == ["node-1"], rb
    assert rb["from_partner"] == [2, 3] and rb["erasure"] == {}, rb
    assert "rebuilt the shards of ranks [2, 3] (lost on node-1)" in res.stderr
    assert res.done["digest"] == reference_digest(N, STEPS)
    # the rebuilt shards were written back on the lost node, with partner copies again
    for step in (STEPS - 1, STEPS):
        assert (res.local / "node-1" / f"step-{step}" / "rank-2.ftk").is_file()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("phase,resume", [
    ("encode", 4), pytest.param("commit", 5, marks=pytest.mark.slow)])
def test_lost_node_rebuilt_from_xor(phase: str, resume: int, tmp_path: Path,
                                    reference_digest: Callable[..., str]) -> None:
    res = _run(tmp_path, "local:1,xor:1", f"node:rank=4:step={FAULT_STEP}:phase={phase}")
    assert res.rc == 0, res.tail()
    assert [s["step"] for s in res.starts] == [0, resume]
    [rb] = _rebuilds(res)
    assert rb["nodes"] == ["node-2"] and rb["from_partner"] == [], rb
    assert rb["erasure"] == {"xor": {"0": [2], "1": [2]}}, rb   # member 2 of both sets
    assert res.done["digest"] == reference_digest(N, STEPS)


@pytest.mark.timeout(900)
def test_two_lost_nodes_rebuilt_from_rs(tmp_path: Path,
                                        reference_digest: Callable[..., str]) -> None:
    """RS sets of 4 with 2 parity: node 1 dies in the job, node 2's disk is lost too."""
    first = _run(tmp_path, "local:1,rs:1", f"node:rank=2:step={FAULT_STEP}:phase=encode",
                 max_restarts=0)
    assert first.rc != 0
    _wipe_node(first, 2)
    res = _run(tmp_path, "local:1,rs:1")
    assert res.rc == 0, res.tail()
    assert res.starts[0]["step"] == FAULT_STEP - 1
    [rb] = _rebuilds(res)
    assert rb["nodes"] == ["node-1", "node-2"] and rb["ranks"] == [2, 3, 4, 5], rb
    assert rb["erasure"] == {"rs": {"0": [1, 2], "1": [1, 2]}}, rb
    assert res.done["digest"] == reference_digest(N, STEPS)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("levels,lost_nodes,needle", [
    ("local:1,partner:1", [1, 2], "unrecoverable at level partner"),
    pytest.param("local:1,xor:1", [1, 2], "unrecoverable at level xor",
                 marks=pytest.mark.slow),
    ("local:1,rs:1", [1, 2, 3], "unrecoverable at level rs"),
])
def test_too_many_lost_nodes_fall_back_clearly(levels: str, lost_nodes: list[int], needle: str,
                                               tmp_path: Path,
                                               reference_digest: Callable[..., str]) -> None:
    """More loss than the level tolerates: a clear message naming the level and the lost
    ranks/nodes, a fallback (here: start over, nothing older survives), no hang, and the
    right model at the end."""
    first = _run(tmp_path, levels, f"node:rank={2 * lost_nodes[0]}:step={FAULT_STEP}"
                                   ":phase=between", max_restarts=0)
    assert first.rc != 0
    for node in lost_nodes[1:]:
        _wipe_node(first, node)
    res = _run(tmp_path, levels)
    assert res.rc == 0, res.tail()
    assert needle in res.stderr, res.tail()
    for node in lost_nodes:
        assert f"node-{node}" in res.stderr
    assert "starting over" in res.stderr
    assert res.starts[0]["step"] == 0
    skips = [e for e in res.events() if e["event"] == "restore-skip"]
    assert skips and all(needle in e["reason"] for e in skips), skips
    assert not _rebuilds(res)
    assert res.done["digest"] == reference_digest(N, STEPS)


@pytest.mark.timeout(900)
def test_corrupted_partner_copy_is_not_used(tmp_path: Path,
                                            reference_digest: Callable[..., str]) -> None:
    """Rank 4 holds rank 2's partner copy; it is corrupted right after it is written. Node 1
    (ranks 2, 3) is then lost: rank 3 comes back from its partner copy, rank 2 from XOR."""
    faults = (f"corrupt:rank=4:step={FAULT_STEP}:level=partner;"
              f"node:rank=2:step={FAULT_STEP + 1}:phase=between")
    res = _run(tmp_path, "local:1,partner:1,xor:1", faults)
    assert res.rc == 0, res.tail()
    assert res.starts[1]["step"] == FAULT_STEP
    [rb] = _rebuilds(res)
    assert rb["from_partner"] == [3] and rb["erasure"] == {"xor": {"0": [1]}}, rb
    assert "partner copy unusable" in res.stderr and "partner-2.ftk" in res.stderr
    assert res.done["digest"] == reference_digest(N, STEPS)


@pytest.mark.timeout(900)
def test_corrupted_parity_is_not_used(tmp_path: Path,
                                      reference_digest: Callable[..., str]) -> None:
    """Set 0 of XOR is ranks 0, 2, 4, 6. Rank 6's parity of step 5 is corrupted, then node 1
    is lost in step 5's commit phase (after the decision, before any rank can start step 6,
    so step 4 is still held everywhere): step 5 cannot be decoded without that parity, so
    restore falls back to step 4 and rebuilds it from its intact parity."""
    faults = (f"corrupt:rank=6:step={FAULT_STEP}:level=xor;"
              f"node:rank=2:step={FAULT_STEP}:phase=commit")
    res = _run(tmp_path, "local:1,xor:1", faults)
    assert res.rc == 0, res.tail()
    skip = [e for e in res.events() if e["event"] == "restore-skip"]
    assert [e["step"] for e in skip] == [FAULT_STEP], skip
    assert "unrecoverable at level xor" in skip[0]["reason"]
    assert "xor parity unusable" in res.stderr and "checksum mismatch" in res.stderr
    assert res.starts[1]["step"] == FAULT_STEP - 1
    [rb] = _rebuilds(res)
    assert rb["step"] == FAULT_STEP - 1
    assert res.done["digest"] == reference_digest(N, STEPS)
