"""Node loss on 8 ranks / 4 virtual nodes: rebuild from partner, XOR and RS; a clear,
non-destructive stop when no committed step can be rebuilt; copies and parity corrupted in
transfer are refused at encode, so they are never committed.

The job is ``examples/toy_numpy.py`` (NumPy and mpi4py): a rebuild works on shard bytes,
whatever the state held, and 8 ranks of it start in ~4 s where 8 of the torch toy take ~17 s
on a 2-core machine. Node losses of torch jobs rebuilt from partner and XOR copies:
tests/e2e/test_hp_faults.py and tests/e2e/test_in_job.py."""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.jobs import NUMPY_TOY, Result, run_toy, tree_digests

N, STEPS, FAULT_STEP = 8, 8, 5


def _run(tmp: Path, levels: str, faults: str = "", **kw: object) -> Result:
    return run_toy(tmp, n=N, steps=STEPS, FTKIT_LEVELS=levels, FTKIT_FAULTS=faults,
                   script=NUMPY_TOY, **kw)  # type: ignore[arg-type]


def _rebuilds(res: Result) -> list[dict]:
    return [e for e in res.events() if e["event"] == "rebuild"]


def _wipe_node(res: Result, node: int) -> None:
    """What a lost node looks like to the relaunched job: its local directory is gone."""
    shutil.rmtree(res.local / f"node-{node}")


def _node_losses(tmp: Path, levels: str, rank: int, chain: list[tuple[str, int]]
                 ) -> tuple[Result, list[dict]]:
    """One job whose attempt i loses the node of ``rank`` (its processes and its local
    directory) in phase ``chain[i][0]`` of step 4 + i; attempt i + 1 must resume at
    ``chain[i][1]``, after exactly one rebuild of that step. Returns the outcome and the
    rebuild events in order."""
    faults = ";".join(f"node:rank={rank}:step={4 + i}:phase={phase}:attempt={i}"
                      for i, (phase, _) in enumerate(chain))
    res = _run(tmp, levels, faults, max_restarts=len(chain))
    assert res.rc == 0, res.tail()
    assert [s["step"] for s in res.starts] == [0] + [r for _, r in chain], res.tail()
    rebuilds = _rebuilds(res)
    assert [rb["step"] for rb in rebuilds] == [r for _, r in chain], rebuilds
    return res, rebuilds


@pytest.mark.timeout(900)
def test_lost_node_rebuilt_from_partner(tmp_path: Path,
                                        reference_digest: Callable[..., str]) -> None:
    """Node 1 lost three times, in three phases: each relaunch rebuilds ranks 2 and 3's
    shards from their partner copies on node 0. (A node lost between two saves, rebuilt
    from partner copies: tests/e2e/test_hp_faults.py::test_lost_node_rebuilt_from_partner
    and, in the running job, tests/e2e/test_in_job.py.)"""
    chain = [("write-local", 3), ("encode", 4), ("commit", 6)]
    res, rebuilds = _node_losses(tmp_path, "local:1,partner:1", 2, chain)
    for rb in rebuilds:
        assert rb["nodes"] == ["node-1"], rb
        assert rb["from_partner"] == [2, 3] and rb["erasure"] == {}, rb
    assert "rebuilt the shards of ranks [2, 3] (lost on node-1)" in res.stderr
    assert res.done["digest"] == reference_digest(N, STEPS, script=NUMPY_TOY)
    # the rebuilt shards were written back on the lost node, with partner copies again
    for step in (STEPS - 1, STEPS):
        assert (res.local / "node-1" / f"step-{step}" / "rank-2.ftk").is_file()


@pytest.mark.timeout(900)
def test_lost_node_rebuilt_from_xor(tmp_path: Path,
                                    reference_digest: Callable[..., str]) -> None:
    res, rebuilds = _node_losses(tmp_path, "local:1,xor:1", 4, [("encode", 3), ("commit", 5)])
    for rb in rebuilds:
        assert rb["nodes"] == ["node-2"] and rb["from_partner"] == [], rb
        assert rb["erasure"] == {"xor": {"0": [2], "1": [2]}}, rb   # member 2 of both sets
    assert res.done["digest"] == reference_digest(N, STEPS, script=NUMPY_TOY)


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
    assert res.done["digest"] == reference_digest(N, STEPS, script=NUMPY_TOY)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("levels,lost_nodes,needle", [
    ("local:1,partner:1", [1, 2], "unrecoverable at level partner"),
    pytest.param("local:1,xor:1", [1, 2], "unrecoverable at level xor",
                 marks=pytest.mark.slow),
    ("local:1,rs:1", [1, 2, 3], "unrecoverable at level rs"),
])
def test_too_many_lost_nodes_fall_back_clearly(levels: str, lost_nodes: list[int], needle: str,
                                               tmp_path: Path,
                                               reference_digest: Callable[..., str]) -> None:
    """More loss than the level tolerates, with committed steps on disk: restore raises
    UnrecoverableError on every rank, naming the steps, the level, the lost nodes and how to
    start over; nothing is deleted; ``ftkit run`` does not retry it (exit status 3). Starting
    over is explicit: ``ftkit run --fresh`` starts at step 0 and reaches the right model
    (checked once: it does not depend on the level)."""
    first = _run(tmp_path, levels, f"node:rank={2 * lost_nodes[0]}:step={FAULT_STEP}"
                                   ":phase=between", max_restarts=0)
    assert first.rc != 0
    for node in lost_nodes[1:]:
        _wipe_node(first, node)
    before = _committed_files(first.local)
    assert before, "the first launch committed nothing"
    seen = len(first.events())

    res = _run(tmp_path, levels)
    assert res.rc == 3, res.tail()
    [line] = res.attempt_lines()
    assert "not retried" in line, line
    assert "UnrecoverableError" in res.stderr and needle in res.stderr, res.tail()
    for node in lost_nodes:
        assert f"node-{node}" in res.stderr, res.tail()
    assert "--fresh" in res.stderr or "FTKIT_START=fresh" in res.stderr, res.tail()
    assert _committed_files(res.local) == before      # every committed step kept, unchanged
    new = res.events()[seen:]
    assert not [e for e in new if e["event"] == "restore" and e.get("step") is not None], new
    assert all(needle in e["reason"] for e in new if e["event"] == "restore-skip"), new
    assert not _rebuilds(res)
    if "partner" not in levels:
        return
    fresh = _run(tmp_path, levels, run_args=("--fresh",))
    assert fresh.rc == 0, fresh.tail()
    assert fresh.starts[0]["step"] == 0, fresh.tail()
    assert fresh.done["digest"] == reference_digest(N, STEPS, script=NUMPY_TOY)


def _committed_files(local: Path) -> dict[str, str]:
    """{path: digest} of every file in a committed node-local step directory."""
    return {path: digest for path, digest in tree_digests(local).items()
            if (local / path).parent.joinpath("COMMITTED").is_file()}


def _abort_of(res: Result, step: int) -> dict:
    [abort] = [e for e in res.events() if e["event"] == "abort" and e["step"] == step]
    return abort


@pytest.mark.timeout(900)
def test_corrupted_partner_copy_is_not_used(tmp_path: Path,
                                            reference_digest: Callable[..., str]) -> None:
    """Rank 4 holds rank 2's partner copy. Step 5's copy is corrupted in transfer: rank 4
    refuses it while it streams in, votes no, and step 5 is aborted (step 4 stays the
    newest committed step). The relaunch resumes at step 4 and saves step 5 again with a
    verified copy; node 1 (ranks 2, 3) is then lost, and both shards come back from their
    partner copies."""
    faults = (f"corrupt:rank=4:step={FAULT_STEP}:level=partner;"
              f"node:rank=2:step={FAULT_STEP + 1}:phase=between:attempt=1")
    res = _run(tmp_path, "local:1,partner:1", faults)
    assert res.rc == 0, res.tail()
    abort = _abort_of(res, FAULT_STEP)
    assert list(abort["failures"]) == ["4"], abort
    why = abort["failures"]["4"]
    assert "CorruptCheckpointError" in why and "partner-2.ftk" in why, why
    assert "from rank 2" in why and "level partner" in why and f"step {FAULT_STEP}" in why
    assert FAULT_STEP not in res.committed(0) and max(res.committed(0)) == FAULT_STEP - 1
    assert [s["step"] for s in res.starts] == [0, FAULT_STEP - 1, FAULT_STEP], res.tail()
    [rb] = _rebuilds(res)
    assert rb["step"] == FAULT_STEP and rb["from_partner"] == [2, 3], rb
    assert res.done["digest"] == reference_digest(N, STEPS, script=NUMPY_TOY)


@pytest.mark.timeout(900)
def test_corrupted_parity_is_not_used(tmp_path: Path,
                                      reference_digest: Callable[..., str]) -> None:
    """Set 0 of XOR is ranks 0, 2, 4, 6. The parity rank 6 receives for step 5 is corrupted
    in transfer: rank 6 checks it against the members' data folds, refuses to write it and
    votes no, so step 5 is aborted and no COMMITTED ever covers that parity. The relaunch
    resumes at step 4 and saves step 5 again with good parity; node 1 is then lost and step
    5 is rebuilt from that parity (member 1 of both sets)."""
    faults = (f"corrupt:rank=6:step={FAULT_STEP}:level=xor;"
              f"node:rank=2:step={FAULT_STEP + 1}:phase=between:attempt=1")
    res = _run(tmp_path, "local:1,xor:1", faults)
    assert res.rc == 0, res.tail()
    abort = _abort_of(res, FAULT_STEP)
    assert list(abort["failures"]) == ["6"], abort
    why = abort["failures"]["6"]
    assert "xor-0-3.ftk" in why and "corrupted in transfer" in why, why
    assert "level xor" in why and f"step {FAULT_STEP}" in why, why
    assert FAULT_STEP not in res.committed(0) and max(res.committed(0)) == FAULT_STEP - 1
    assert not [e for e in res.events() if e["event"] == "restore-skip"]
    assert [s["step"] for s in res.starts] == [0, FAULT_STEP - 1, FAULT_STEP], res.tail()
    [rb] = _rebuilds(res)
    assert rb["step"] == FAULT_STEP and rb["erasure"] == {"xor": {"0": [1], "1": [1]}}, rb
    assert res.done["digest"] == reference_digest(N, STEPS, script=NUMPY_TOY)
