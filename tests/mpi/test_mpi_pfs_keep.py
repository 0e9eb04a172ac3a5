"""PFS retention on 4 ranks / 2 virtual nodes: ``local:1,pfs:1`` with ``FTKIT_PFS_KEEP``
keeps the newest N committed PFS steps; each flush event names the steps it retired, and a
restore with every node-local directory gone still finds the newest step on the PFS."""
from __future__ import annotations

import shutil

import pytest

from ftkit import Checkpointer, Config

from .mpi_helpers import RANK, WORLD, allgather, canon, diff, events, small_state, topology
from .test_mpi_pfs_degrade import committed_pfs_steps


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_only_the_newest_pfs_steps_stay(ftkit_env, async_) -> None:
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=async_, levels="local:1,pfs:1",
                                              pfs_keep=2, pfs_backpressure="wait"))
        for step in range(1, 6):
            ckpt.save(step, small_state(RANK, step))
        ckpt.close()
        pfs_job = ftkit_env.pfs_dir / ftkit_env.job
        assert committed_pfs_steps(pfs_job) == [4, 5]
        listed = WORLD.bcast(sorted(p.name for p in pfs_job.glob("step-*")) if RANK == 0
                             else None, root=0)
        assert listed == ["step-4", "step-5"], listed        # nothing left of 1-3
        flushes = [(e["step"], e["removed"]) for e in events(ftkit_env.events_path)
                   if e["event"] == "flush"]
        assert flushes == [(1, []), (2, []), (3, [1]), (4, [2]), (5, [3])], flushes
        WORLD.Barrier()
        if topo.is_node_leader:
            shutil.rmtree(ftkit_env.node_dir(topo.node))     # each node loses its own
        WORLD.Barrier()
        fresh = Checkpointer(topo, Config.load(async_=async_, levels="local:1,pfs:1"))
        state = small_state(RANK, 0)
        got = fresh.restore(state)
        fresh.close()
    assert allgather(got) == [5] * 4
    assert diff(canon(small_state(RANK, 5)), canon(state)) == []


def test_a_failed_flush_removes_nothing(ftkit_env) -> None:
    """``pfs:1``, keep 2; the flush of step 3 fails on rank 1. Nothing is removed for it (a
    step goes only after a newer one is committed): steps 1 and 2 stay until step 4 commits,
    which then retires step 1 only (the newest two committed are 4 and 2)."""
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=False, levels="local:1,pfs:1",
                                              pfs_keep=2,
                                              faults="raise:rank=1:step=3:phase=flush"))
        pfs_job = ftkit_env.pfs_dir / ftkit_env.job
        seen = []
        for step in range(1, 5):
            ckpt.save(step, small_state(RANK, step))
            seen.append(committed_pfs_steps(pfs_job))
        ckpt.close()
    assert seen == [[1], [1, 2], [1, 2], [2, 4]], seen
    flushes = [(e["step"], e["removed"]) for e in events(ftkit_env.events_path)
               if e["event"] == "flush"]
    assert flushes == [(1, []), (2, []), (4, [1])], flushes


def test_close_after_a_restore_does_not_flush_a_step_the_pfs_holds(ftkit_env) -> None:
    """Step 2 was flushed when due; a new Checkpointer restores it from the node-local level
    and closes without saving: the PFS step is not written again (before: close() flushed
    it anew, with a warning about an older timeline)."""
    levels = "local:1,pfs:2"
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(levels=levels))
        for step in (1, 2):
            ckpt.save(step, small_state(RANK, step))
        ckpt.close()
        committed = ftkit_env.pfs_dir / ftkit_env.job / "step-2" / "COMMITTED"
        before = allgather(committed.stat().st_ino)
        state = small_state(RANK, 0)
        ckpt = Checkpointer(topo, Config.load(levels=levels))
        assert ckpt.restore(state) == 2
        ckpt.close()
        assert ckpt.last_flushed == 2
    assert allgather(committed.stat().st_ino) == before
    flushes = [e["step"] for e in events(ftkit_env.events_path) if e["event"] == "flush"]
    restores = [(e["step"], e["level"]) for e in events(ftkit_env.events_path)
                if e["event"] == "restore"]
    assert flushes == [2] and restores == [(2, "local")], (flushes, restores)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_close_flushes_the_final_step_that_was_not_due(ftkit_env, async_) -> None:
    """``local:1,pfs:4``, steps 1-6: step 4 is flushed when due; the final step 6 is not
    due, and ``close()`` flushes it, so the finished job's final state is on the PFS (before:
    only in node-local memory)."""
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=async_, levels="local:1,pfs:4"))
        for step in range(1, 7):
            ckpt.save(step, small_state(RANK, step))
        ckpt.close()
        assert ckpt.last_flushed == 6
    assert committed_pfs_steps(ftkit_env.pfs_dir / ftkit_env.job) == [4, 6]
    flushes = [e["step"] for e in events(ftkit_env.events_path) if e["event"] == "flush"]
    assert flushes == [4, 6], flushes
