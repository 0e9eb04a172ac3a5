"""The hybrid-parallel GPT (dp2 x tp2 x pp2, 8 ranks on 4 virtual nodes) survives a killed
rank, a lost node and a corrupted node-local shard, each injected at a step the test draws
at random, and ends bit-identical to a failure-free run of the same layout.

The step is drawn from ``HP_FAULTS_SEED`` (default: a fresh seed, printed, so a failing
draw can be replayed)."""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.e2e.jobs import Result, run_example

STEPS = 10
LAYOUT = ("--dp", "2", "--tp", "2", "--pp", "2", "--steps", str(STEPS), "--seed", "3")
LEVELS = "local:1,partner:1"
SEED = int(os.environ.get("HP_FAULTS_SEED", random.SystemRandom().randrange(1 << 30)))


def _draw(salt: str) -> tuple[int, int]:
    """(step, rank) for one case; step leaves room before and after the fault."""
    rng = random.Random(f"{SEED}-{salt}")
    step, rank = rng.randrange(3, STEPS - 1), rng.randrange(8)
    print(f"HP_FAULTS_SEED={SEED}: {salt}: step {step}, rank {rank}")
    return step, rank


def _run(tmp: Path, faults: str = "", restarts: int = 2) -> Result:
    return run_example(tmp, "hp_gpt.py", n=8, args=LAYOUT, max_restarts=restarts,
                       FTKIT_LEVELS=LEVELS, FTKIT_FAULTS=faults)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Result:
    res = _run(tmp_path_factory.mktemp("hp-ref"), restarts=0)
    assert res.rc == 0, res.tail()
    return res


def _losses(res: Result) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in res.json_lines() if r.get("event") == "step"]


def _assert_recovered(res: Result, resume: int, reference: Result) -> None:
    """One relaunch, resumed at ``resume``; every printed loss (replayed steps included) and
    the whole final state (parameters, Adam state, RNGs, loader) equal the failure-free run's,
    bit for bit."""
    assert res.rc == 0, res.tail()
    starts = res.starts
    assert [s["attempt"] for s in starts] == [0, 1], (starts, res.tail())
    assert starts[1]["step"] == resume, (starts, res.tail())
    expected = dict(_losses(reference))
    assert all(loss == expected[step] for step, loss in _losses(res)), _losses(res)
    assert {s for s, _ in _losses(res)} == set(expected), _losses(res)
    assert res.done["digest"] == reference.done["digest"], res.tail()


@pytest.mark.timeout(900)
def test_killed_rank(tmp_path: Path, reference: Result) -> None:
    step, rank = _draw("kill")
    res = _run(tmp_path, f"kill:rank={rank}:step={step}:phase=write-local")
    _assert_recovered(res, step - 1, reference)


@pytest.mark.timeout(900)
def test_lost_node_rebuilt_from_partner(tmp_path: Path, reference: Result) -> None:
    step, rank = _draw("node")
    res = _run(tmp_path, f"node:rank={rank}:step={step}:phase=between")
    _assert_recovered(res, step - 1, reference)
    node = rank // 2
    [rb] = [e for e in res.events() if e["event"] == "rebuild"]
    assert sorted(rb["from_partner"]) == [2 * node, 2 * node + 1], rb


@pytest.mark.timeout(900)
def test_corrupted_local_shard(tmp_path: Path, reference: Result) -> None:
    """A byte of rank R's node-local shard of step S flips on disk right after it was written.
    R's partner (the rank that receives its copy, on another node) verifies every byte as
    it lands and refuses it, so the damage is never kept as a copy: the partner votes no,
    step S is aborted on every rank, the job fails with that CheckpointError, and the
    relaunch resumes from step S-1."""
    step, rank = _draw("corrupt")
    res = _run(tmp_path, f"corrupt:rank={rank}:step={step}:level=local")
    _assert_recovered(res, step - 1, reference)
    [abort] = [e for e in res.events() if e["event"] == "abort"]
    [(holder, why)] = abort["failures"].items()
    assert abort["step"] == step and int(holder) // 2 != rank // 2, abort    # another node
    assert "checksum mismatch" in why and f"from rank {rank}" in why, abort
    assert f"partner-{rank}.ftk" in why, abort
