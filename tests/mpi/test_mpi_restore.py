"""Restore corner cases on 4 ranks / 2 virtual nodes: corrupt or foreign shards make every
rank fall back to the previous step; nothing committed restores 0.

A rank only touches files in its own node's directory (rank 2 owns node 1's, ranks 0-1 node
0's), as the code under test must.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest

from ftkit import Checkpointer, Config
from ftkit.faults import flip_byte

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
    save_steps,
    small_state,
    topology,
)

NODE = RANK // 2


def restore_fresh(topo, **overrides) -> tuple[int, dict]:
    state = small_state(RANK, 0)
    ckpt = Checkpointer(topo, Config.load(**overrides))
    step = ckpt.restore(state)
    ckpt.close()
    return step, state


@pytest.mark.parametrize("how", ["flip_byte", "fault-spec"])
def test_corrupt_newest_shard_of_rank_2_falls_back(ftkit_env, how):
    with topology() as topo:
        if how == "flip_byte":
            expected = save_steps(topo, [1, 2])
            if RANK == 2:          # rank 2 lives on node 1 and owns that directory
                flip_byte(ftkit_env.step_dir(1, 2) / "rank-2.ftk")
        else:                      # corrupted right after it was written, then committed
            expected = save_steps(topo, [1, 2], faults="corrupt:rank=2:step=2:level=local")
        WORLD.Barrier()
        step, state = restore_fresh(topo)
    assert allgather(step) == [1] * 4
    assert allgather(diff(expected[1], canon(state))) == [[]] * 4
    evs = events(ftkit_env.events_path)
    skips = [e for e in evs if e["event"] == "restore-skip"]
    assert len(skips) == 1, evs
    assert skips[0]["step"] == 2 and list(skips[0]["failures"]) == ["2"]
    why = skips[0]["failures"]["2"]
    assert "rank-2.ftk" in why and "checksum" in why
    restores = [e for e in evs if e["event"] == "restore"]
    assert [(e["step"], e["skipped"]) for e in restores] == [(1, [2])]


def test_nothing_committed_restores_zero(ftkit_env):
    with topology() as topo:
        state = small_state(RANK, 5)
        before = canon(state)
        ckpt = Checkpointer(topo, Config.load())
        step = ckpt.restore(state)
        ckpt.close()
    evs = events(ftkit_env.events_path)
    assert allgather((step, diff(before, canon(state)))) == [(0, [])] * 4
    assert [(e["event"], e["step"]) for e in evs] == [("restore", 0)]


def test_only_an_aborted_step_restores_zero(ftkit_env):
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=False,
                                              faults="raise:rank=3:step=1:phase=vote"))
        error = catch(ckpt.save, 1, small_state(RANK, 1))
        ckpt.close()
        step, _ = restore_fresh(topo)
    assert allgather((type(error).__name__, step)) == [("CheckpointError", 0)] * 4


# the rank that replaces its own newest shard, and how
FOREIGN = ["garbage", "other-rank", "other-step", "truncated", "missing", "empty"]


@pytest.mark.parametrize("how", FOREIGN)
def test_foreign_shard_falls_back_to_previous_step(ftkit_env, how):
    victim = 1                                      # on node 0 with rank 0
    with topology() as topo:
        expected = save_steps(topo, [1, 2])
        if RANK == victim:
            shard = ftkit_env.step_dir(0, 2) / f"rank-{victim}.ftk"
            size = shard.stat().st_size
            if how == "garbage":
                shard.write_bytes(os.urandom(size))
            elif how == "other-rank":          # a valid shard, of rank 0 (same node)
                shutil.copyfile(ftkit_env.step_dir(0, 2) / "rank-0.ftk", shard)
            elif how == "other-step":          # a valid shard of this rank, of step 1
                shutil.copyfile(ftkit_env.step_dir(0, 1) / f"rank-{victim}.ftk", shard)
            elif how == "truncated":
                os.truncate(shard, size // 2)
            elif how == "missing":
                shard.unlink()
            elif how == "empty":
                shard.write_bytes(b"")
        WORLD.Barrier()
        step, state = restore_fresh(topo)
    assert allgather(step) == [1] * 4
    assert allgather(diff(expected[1], canon(state))) == [[]] * 4
    skips = [e for e in events(ftkit_env.events_path) if e["event"] == "restore-skip"]
    assert [(e["step"], list(e["failures"])) for e in skips] == [(2, [str(victim)])]


def test_restore_then_continue_saving(ftkit_env):
    """After falling back to step 1 the job saves step 2 again, and that is restorable."""
    with topology() as topo:
        save_steps(topo, [1, 2])
        if RANK == 3:
            flip_byte(ftkit_env.step_dir(1, 2) / "rank-3.ftk")
        WORLD.Barrier()
        state = small_state(RANK, 0)
        ckpt = Checkpointer(topo, Config.load())
        first = ckpt.restore(state)
        again = small_state(RANK, 22)
        ckpt.save(2, again)
        ckpt.close()
        step, restored = restore_fresh(topo)
    everyone = allgather((first, step, diff(canon(again), canon(restored))))
    assert everyone == [(1, 2, [])] * 4, everyone


def test_committed_step_of_another_world_size_is_refused(ftkit_env):
    """A committed step whose record says 8 ranks: every rank refuses it, nothing changes."""
    with topology() as topo:
        save_steps(topo, [1])
        if RANK % 2 == 0:                       # each node leader edits its own node's record
            path = ftkit_env.step_dir(NODE, 1) / "COMMITTED"
            path.write_text(json.dumps({**json.loads(path.read_text()), "world": 8}))
        WORLD.Barrier()
        state = small_state(RANK, 0)
        before = canon(state)
        ckpt = Checkpointer(topo, Config.load())
        error = error_summary(catch(ckpt.restore, state))
        ckpt.close()
        listing = node_listing(ftkit_env.step_dir(NODE, 1))
    everyone = allgather((error, listing, diff(before, canon(state))))
    errors = [e[0] for e in everyone]
    assert all(e == errors[0] for e in errors), errors
    assert errors[0] is not None and errors[0][0] == "UnrecoverableError"
    assert "8 ranks" in errors[0][3] and "this job has 4" in errors[0][3]
    assert "Nothing was deleted" in errors[0][3]
    for r, (_, listing, changed) in enumerate(everyone):
        assert {"COMMITTED", f"rank-{r}.ftk"} <= set(listing or ()), (r, listing)
        assert changed == [], (r, changed)


def test_restore_load_failure_on_one_rank_is_the_same_error_everywhere(ftkit_env):
    """Rank 3's live state lacks a key of the checkpoint: phase restore-load fails there,
    and every rank raises the same StateMismatchError (not retried) naming rank 3."""
    with topology() as topo:
        save_steps(topo, [1])
        state = small_state(RANK, 0)
        if RANK == 3:
            del state["np"]
        ckpt = Checkpointer(topo, Config.load())
        error = error_summary(catch(ckpt.restore, state))
        ckpt.close()
    errors = allgather(error)
    assert all(e == errors[0] for e in errors), errors
    kind, step, failures, message = errors[0]
    assert (kind, step) == ("StateMismatchError", 1)
    assert [r for r, _ in failures] == [3] and "np" in failures[0][1]
    assert "does not match the checkpoint of step 1" in message


def test_missing_shard_is_reported_on_its_own_node(ftkit_env):
    with topology() as topo:
        save_steps(topo, [1, 2])
        if RANK == 3:
            (ftkit_env.step_dir(1, 2) / "rank-3.ftk").unlink()
        WORLD.Barrier()
        step, _ = restore_fresh(topo)
    skips = [e for e in events(ftkit_env.events_path) if e["event"] == "restore-skip"]
    assert allgather(step) == [1] * 4
    assert [(e["step"], list(e["failures"])) for e in skips] == [(2, ["3"])]
    assert "node-1" in skips[0]["failures"]["3"], skips[0]["failures"]["3"]


def test_a_damaged_partner_copy_is_found_by_the_rebuild_that_uses_it(ftkit_env):
    """Discovery reads partner copies by their headers only. Node 0 loses its directory;
    node 1 holds the partner copies of ranks 0 and 1, and the step-2 copy of one of them has
    a flipped byte. The rebuild of step 2 streams it, the receiver's check refuses it, and
    step 2 is looked at again with every byte: the damaged copy makes it unrecoverable, so
    step 2 is skipped (kept) and step 1 is rebuilt from its intact copies and loaded."""
    levels = "local:1,partner:1"
    with topology() as topo:
        expected = save_steps(topo, [1, 2], levels=levels)
        damaged = min(p.name for p in ftkit_env.step_dir(1, 2).glob("partner-*.ftk"))
        if RANK == 2:               # rank 2 leads node 1, which holds the copies
            flip_byte(ftkit_env.step_dir(1, 2) / damaged)
        _lose_node_0(ftkit_env)
        step, state = restore_fresh(topo, levels=levels)
    assert allgather(step) == [1] * 4
    assert allgather(diff(expected[1], canon(state))) == [[]] * 4
    evs = events(ftkit_env.events_path)
    [skip] = [e for e in evs if e["event"] == "restore-skip"]
    assert skip["step"] == 2 and damaged in skip["reason"] and "partner" in skip["reason"], skip
    assert [(e["step"], e["ranks"]) for e in evs if e["event"] == "rebuild"] == [(1, [0, 1])]
    assert (ftkit_env.node_dir(1) / "parked-step-2" / damaged).is_file()   # kept, aside


def test_damaged_parity_is_found_by_the_rebuild_that_decodes_it(ftkit_env):
    """The same with XOR parity (sets of one rank per node): discovery reads the parity's
    header only, the shard decoded from damaged parity fails its verification, step 2 is
    looked at again with every byte and skipped; step 1 is decoded and loaded."""
    levels = "local:1,xor:1"
    with topology() as topo:
        expected = save_steps(topo, [1, 2], levels=levels, xor_set=2)
        damaged = sorted(p.name for p in ftkit_env.step_dir(1, 2).glob("xor-*.ftk"))
        if RANK == 2:
            for name in damaged:
                flip_byte(ftkit_env.step_dir(1, 2) / name)
        _lose_node_0(ftkit_env)
        step, state = restore_fresh(topo, levels=levels, xor_set=2)
    assert damaged and allgather(step) == [1] * 4
    assert allgather(diff(expected[1], canon(state))) == [[]] * 4
    evs = events(ftkit_env.events_path)
    [skip] = [e for e in evs if e["event"] == "restore-skip"]
    assert skip["step"] == 2 and "xor" in skip["reason"], skip
    assert [(e["step"], e["ranks"]) for e in evs if e["event"] == "rebuild"] == [(1, [0, 1])]


def _lose_node_0(ftkit_env) -> None:
    """Node 0's directory is gone (its leader, rank 0, removes it) once every rank got here."""
    WORLD.Barrier()
    if RANK == 0:
        shutil.rmtree(ftkit_env.node_dir(0))
    WORLD.Barrier()
