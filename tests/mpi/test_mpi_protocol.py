"""The two-phase coordinated checkpoint on 4 ranks / 2 virtual nodes: commit, abort,
decision record, retention."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftkit import Checkpointer, Config

from .mpi_helpers import (
    RANK,
    WORLD,
    allgather,
    canon,
    catch,
    diff,
    error_summary,
    events,
    node_listing,
    small_state,
    topology,
)

NODE = RANK // 2          # FTKIT_RANKS_PER_NODE=2

# how step 3 fails: (Config.load overrides, failing rank, text in the failure)
FAILURES = {
    "capture-unsupported": ({}, 1, "cannot checkpoint meta/bad"),
    "raise-write-local": ({"faults": "raise:rank=1:step=3:phase=write-local"}, 1,
                          "InjectedFault: injected fault at rank 1, node 0, phase write-local"),
    "raise-vote": ({"faults": "raise:rank=1:step=3:phase=vote"}, 1, "phase vote, step 3"),
    "raise-decide-coordinator": ({"faults": "raise:rank=0:step=3:phase=decide"}, 0,
                                 "phase decide, step 3"),
}


def save_and_wait(ckpt: Checkpointer, step: int, state: dict) -> None:
    ckpt.save(step, state)
    ckpt.wait()


def record_of(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("how", list(FAILURES))
def test_failed_save_aborts_everywhere_and_previous_step_survives(ftkit_env, how, async_):
    overrides, bad_rank, text = FAILURES[how]
    states = {s: small_state(RANK, s) for s in (1, 2, 3)}
    expected2 = canon(states[2])
    obs = {}
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=async_, **overrides))
        save_and_wait(ckpt, 1, states[1])
        save_and_wait(ckpt, 2, states[2])
        if how == "capture-unsupported" and RANK == bad_rank:
            states[3]["meta"]["bad"] = object()       # only rank 1 cannot capture
        # async: save returns after capture and the error surfaces at wait()
        obs["error"] = error_summary(catch(save_and_wait, ckpt, 3, states[3]))
        ckpt.close()
        # step 3: no decision record and no shard (temporary or final) on any node
        obs["listing3"] = node_listing(ftkit_env.step_dir(NODE, 3))
        # step 2 is still permanent on every node, with this rank's shard
        obs["listing2"] = node_listing(ftkit_env.step_dir(NODE, 2))
        evs = events(ftkit_env.events_path)

        # a new job restores step 2, bit-exact, and drops the aborted step's directory
        restored = small_state(RANK, 0)
        ckpt2 = Checkpointer(topo, Config.load(async_=async_))
        obs["restored"] = ckpt2.restore(restored)
        obs["problems"] = diff(expected2, canon(restored))
        obs["listing3_after_restore"] = node_listing(ftkit_env.step_dir(NODE, 3))
        WORLD.Barrier()                               # everyone looked before step 3 again
        # ... and checkpoints step 3 this time
        save_and_wait(ckpt2, 3, small_state(RANK, 3))
        obs["committed3"] = (ftkit_env.step_dir(NODE, 3) / "COMMITTED").is_file()
        ckpt2.close()
    everyone = allgather(obs)

    errors = [o["error"] for o in everyone]
    assert all(e == errors[0] for e in errors), f"different errors on the ranks: {errors}"
    kind, step, failures, message = errors[0]
    assert (kind, step) == ("CheckpointError", 3)
    assert [r for r, _ in failures] == [bad_rank]
    assert text in failures[0][1]
    assert "aborted" in message
    assert [o["listing3"] in (None, []) for o in everyone] == [True] * 4, everyone
    for r, o in enumerate(everyone):
        assert "COMMITTED" in o["listing2"] and f"rank-{r}.ftk" in o["listing2"], (r, o)
    aborts = [(e["step"], list(e["failures"])) for e in evs if e["event"] == "abort"]
    assert aborts == [(3, [str(bad_rank)])]
    assert [e["step"] for e in evs if e["event"] == "commit"] == [1, 2]
    assert [o["restored"] for o in everyone] == [2] * 4
    assert [o["problems"] for o in everyone] == [[]] * 4
    assert [o["listing3_after_restore"] for o in everyone] == [None] * 4
    assert [o["committed3"] for o in everyone] == [True] * 4


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_commit_record_on_every_node(ftkit_env, async_):
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=async_))
        ckpt.save(1, small_state(RANK, 1))
        ckpt.wait()
        record = record_of(ftkit_env.step_dir(NODE, 1) / "COMMITTED")
        last = ckpt.last_committed
        ckpt.close()
    everyone = allgather((record, last))
    for record, last in everyone:
        assert record is not None
        assert (record["step"], record["decision"], record["world"]) == (1, "commit", 4)
        assert last == 1


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_decision_is_durable_on_coordinator_node_before_announce(ftkit_env, async_):
    """Rank 2 (leader of node 1) fails in phase commit: the coordinator's node already holds
    the decision, so step 1 *is* committed; every rank reports the late failure, and a
    restore completes node 1's record."""
    state = small_state(RANK, 1)
    expected = canon(state)
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=async_,
                                              faults="raise:rank=2:step=1:phase=commit"))
        error = error_summary(catch(save_and_wait, ckpt, 1, state))
        ckpt.close()
        have = (ftkit_env.step_dir(NODE, 1) / "COMMITTED").is_file()
        WORLD.Barrier()
        restored = small_state(RANK, 0)
        ckpt2 = Checkpointer(topo, Config.load(async_=async_))
        step = ckpt2.restore(restored)
        record = record_of(ftkit_env.step_dir(NODE, 1) / "COMMITTED")
        ckpt2.close()
    everyone = allgather((error, have, step, diff(expected, canon(restored)), record))
    errors = [e[0] for e in everyone]
    assert all(e == errors[0] for e in errors), errors
    kind, err_step, failures, message = errors[0]
    assert (kind, err_step) == ("CheckpointError", 1)
    assert [r for r, _ in failures] == [2] and "phase commit, step 1" in failures[0][1]
    assert "committed, but" in message
    assert [e[1] for e in everyone] == [True, True, False, False]
    assert [e[2] for e in everyone] == [1] * 4
    assert [e[3] for e in everyone] == [[]] * 4
    assert [e[4]["step"] for e in everyone] == [1] * 4
    assert [e[4].get("completed_by") for e in everyone] == [None, None, "restore", "restore"]


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_retention_keeps_at_most_two_versions(ftkit_env, async_):
    seen = []
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=async_))
        for step in range(1, 6):
            ckpt.save(step, small_state(RANK, step))
            ckpt.wait()
            seen.append(sorted(p.name for p in ftkit_env.node_dir(NODE).glob("step-*")))
            WORLD.Barrier()           # every rank looked before the next version starts
        ckpt.close()
        final = {s: node_listing(ftkit_env.step_dir(NODE, s)) for s in (4, 5)}
    everyone = allgather((seen, final))
    for r, (seen, final) in enumerate(everyone):
        assert seen == [["step-1"], ["step-1", "step-2"], ["step-2", "step-3"],
                        ["step-3", "step-4"], ["step-4", "step-5"]], (r, seen)
        for listing in final.values():
            assert {f"rank-{r}.ftk", "COMMITTED"} <= set(listing or ()), (r, final)


def test_first_save_without_restore_keeps_committed_step_until_commit(ftkit_env):
    expected = canon(small_state(RANK, 2))
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=False))
        ckpt.save(2, small_state(RANK, 2))
        ckpt.close()
        # a later attempt saves before restoring, and that save aborts
        ckpt2 = Checkpointer(topo, Config.load(async_=False,
                                               faults="raise:rank=3:step=3:phase=vote"))
        error = catch(ckpt2.save, 3, small_state(RANK, 3))
        ckpt2.close()
        restored = small_state(RANK, 0)
        ckpt3 = Checkpointer(topo, Config.load(async_=False))
        step = ckpt3.restore(restored)
        ckpt3.close()
    everyone = allgather((type(error).__name__, step, diff(expected, canon(restored))))
    assert everyone == [("CheckpointError", 2, [])] * 4


def test_node_fault_for_a_later_step_does_not_break_saves(ftkit_env):
    """Regression: a ``node`` fault named by rank= used to raise AttributeError at every
    phase hook (Faults took Topology.rank_node, a list, for a dict)."""
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=False,
                                              faults="node:rank=3:step=99:phase=encode"))
        error = error_summary(catch(ckpt.save, 1, small_state(RANK, 1)))
        ckpt.close()
    assert allgather(error) == [None] * 4


def test_only_steps_due_are_saved(ftkit_env, monkeypatch):
    """FTKIT_LEVELS=local:2: save(1) and save(3) are no-ops, steps 2 and 4 are committed."""
    monkeypatch.setenv("FTKIT_LEVELS", "local:2")
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load())
        for step in range(1, 5):
            ckpt.save(step, small_state(RANK, step))
        ckpt.close()
        listing = sorted(p.name for p in ftkit_env.node_dir(NODE).glob("step-*"))
        evs = events(ftkit_env.events_path)
    assert allgather(listing) == [["step-2", "step-4"]] * 4
    assert [(e["event"], e["step"]) for e in evs] == [("commit", 2), ("commit", 4)]


def test_aborted_resave_of_a_committed_step_keeps_the_permanent_version(ftkit_env):
    state = small_state(RANK, 2)
    expected = canon(state)
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=False))
        ckpt.save(2, state)
        ckpt.close()
        # the next attempt restores step 2, saves step 2 again, and that save aborts
        ckpt2 = Checkpointer(topo, Config.load(async_=False,
                                               faults="raise:rank=3:step=2:phase=vote"))
        first = ckpt2.restore(small_state(RANK, 0))
        error = catch(ckpt2.save, 2, small_state(RANK, 22))
        ckpt2.close()
        restored = small_state(RANK, 0)
        ckpt3 = Checkpointer(topo, Config.load(async_=False))
        step = ckpt3.restore(restored)
        ckpt3.close()
    everyone = allgather((first, type(error).__name__, step, diff(expected, canon(restored))))
    assert everyone == [(2, "CheckpointError", 2, [])] * 4, everyone


def test_unusable_local_dir_on_one_node_is_config_error_everywhere(ftkit_env):
    """Node 1's directory is a plain file: ranks 2 and 3 cannot prepare it, and every rank
    raises the same ConfigError naming them (nobody hangs in a later collective)."""
    if RANK == 0:
        ftkit_env.local_dir.mkdir(mode=0o700, exist_ok=True)
        ftkit_env.node_dir(1).parent.mkdir(mode=0o700)
        ftkit_env.node_dir(1).write_text("not a directory")
    WORLD.Barrier()
    with topology() as topo:
        error = catch(Checkpointer, topo, Config.load())
    errors = allgather((type(error).__name__, str(error)))
    assert all(e == errors[0] for e in errors), errors
    kind, message = errors[0]
    assert kind == "ConfigError"
    assert "rank 2" in message and "rank 3" in message and "rank 0" not in message
    assert "node-1" in message


def test_a_save_that_fails_nowhere_costs_three_fixed_size_collectives(ftkit_env):
    """Vote, decision and commit agreement of a save where nothing fails: one fixed-size
    allreduce (no-vote flag, step range, flush still running), one fixed-size broadcast and
    one fixed-size allreduce, 72 bytes delivered to each rank whatever the world size (no
    gather of votes, no allgather of failures). A
    failed save gathers the details, and every rank still sees the same failures."""
    from ftkit.passes import collective_counts
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=False))
        ckpt.save(1, small_state(RANK, 1))
        before = collective_counts()
        ckpt.save(2, small_state(RANK, 2))
        after = collective_counts()
        ckpt.close()
    got = allgather({k: after[k] - before[k] for k in after})
    assert got == [{"rounds": 3, "bytes": 72}] * WORLD.size, got
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=False,
                                              faults="raise:rank=2:step=4:phase=vote"))
        ckpt.save(3, small_state(RANK, 3))
        err = catch(ckpt.save, 4, small_state(RANK, 4))
        ckpt.close()
    failures = allgather(sorted(err.failures) if err is not None else None)
    assert failures == [[2]] * WORLD.size, failures
