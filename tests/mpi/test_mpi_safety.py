"""A committed step is never lost: restore refuses (and deletes nothing) when committed steps
exist but none can be used; other runs' steps and other-shaped states are refused; starting
over is explicit; steps newer than the restored one are parked, not deleted; a PFS flush
failure is known identically on every rank and raised on none (test_mpi_pfs_degrade.py has
the rest of that policy); the final load verifies what it loads.

4 ranks / 2 virtual nodes (FTKIT_RANKS_PER_NODE=2) unless a test changes it.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import torch

from ftkit import Checkpointer, Config, StateMismatchError, UnrecoverableError
from ftkit.faults import flip_byte
from ftkit.storage.shard import Shard

from .mpi_helpers import (
    RANK,
    WORLD,
    allgather,
    canon,
    catch,
    diff,
    error_summary,
    events,
    save_steps,
    small_state,
    topology,
)


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256) but the job locks (``LOCK``:
    every holder describes itself there; not checkpoint data), as rank 0 sees it, on every
    rank."""
    listing = None
    if RANK == 0:
        listing = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
                   for p in sorted(root.rglob("*")) if p.is_file() and p.name != "LOCK"}
    return WORLD.bcast(listing, root=0)


def try_restore(topo, state, **overrides):
    ckpt = Checkpointer(topo, Config.load(**overrides))
    step = None
    error = catch(lambda: setattr(ckpt, "_got", ckpt.restore(state)))
    if error is None:
        step = ckpt._got
    ckpt.close()
    return step, error


def test_unusable_steps_are_kept_and_named(ftkit_env, monkeypatch):
    """Saved with 2 ranks per node, relaunched with 1: the shards are not on the nodes their
    ranks now run on. Restore raises UnrecoverableError everywhere and deletes nothing."""
    with topology() as topo:
        save_steps(topo, [1, 2, 3])
    before = tree_digest(ftkit_env.local_dir)
    assert any("step-3/COMMITTED" in k for k in before), before
    monkeypatch.setenv("FTKIT_RANKS_PER_NODE", "1")
    with topology() as topo:
        _step, error = try_restore(topo, small_state(RANK, 0))
    assert allgather(error_summary(error)) == [error_summary(error)] * 4
    assert isinstance(error, UnrecoverableError), error
    text = str(error)
    for needle in ("step 3", "step 2", "rank->node map", "1:node-0", "1:node-1", "--fresh",
                   "Nothing was deleted"):
        assert needle in text, (needle, text)
    assert tree_digest(ftkit_env.local_dir) == before
    failed = [e for e in events(ftkit_env.events_path) if e["event"] == "restore-failed"]
    assert failed and 3 in failed[0]["steps"], failed


def test_fresh_start_is_explicit(ftkit_env, monkeypatch):
    """FTKIT_START=fresh deletes the job's steps on every level (PFS steps too, even when
    this run has no PFS level), restores 0 and the job saves again."""
    with topology() as topo:
        save_steps(topo, [1, 2], levels="local:1,pfs:2")
    pfs_job = ftkit_env.pfs_dir / ftkit_env.job
    assert (pfs_job / "step-2" / "COMMITTED").is_file()
    monkeypatch.setenv("FTKIT_RANKS_PER_NODE", "1")
    monkeypatch.setenv("FTKIT_START", "fresh")
    with topology() as topo:
        state = small_state(RANK, 0)
        ckpt = Checkpointer(topo, Config.load(async_=False))
        step = ckpt.restore(state)
        ckpt.save(1, small_state(RANK, 1))
        ckpt.close()
    assert allgather(step) == [0] * 4
    assert not list(pfs_job.glob("step-*"))
    fresh = [e for e in events(ftkit_env.events_path) if e["event"] == "fresh-start"]
    assert len(fresh) == 1 and fresh[0]["pfs"] == [2], fresh
    monkeypatch.setenv("FTKIT_START", "resume")
    with topology() as topo:
        step, error = try_restore(topo, small_state(RANK, 0))
    assert allgather((step, error_summary(error))) == [(1, None)] * 4


def test_another_runs_steps_are_refused(ftkit_env, monkeypatch, tmp_path_factory):
    """Same job name and node-local directory, another PFS directory (a new run): the local
    steps of the first run are never resumed, and stay."""
    with topology() as topo:
        save_steps(topo, [1, 2])
    before = tree_digest(ftkit_env.local_dir)
    other = WORLD.bcast(str(tmp_path_factory.mktemp("other-pfs")) if RANK == 0 else None)
    monkeypatch.setenv("FTKIT_PFS_DIR", other)
    with topology() as topo:
        _step, error = try_restore(topo, small_state(RANK, 0))
    assert allgather(error_summary(error)) == [error_summary(error)] * 4
    assert isinstance(error, UnrecoverableError) and "another run" in str(error), error
    assert tree_digest(ftkit_env.local_dir) == before


def test_state_of_another_shape_is_refused(ftkit_env):
    """A model of another shape is refused on every rank before anything is loaded."""
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=False))
        ckpt.save(1, {**small_state(RANK, 1), "model": torch.nn.Linear(4, 8)})
        ckpt.close()
        before = tree_digest(ftkit_env.local_dir)
        state = {**small_state(RANK, 0), "model": torch.nn.Linear(4, 3 if RANK == 2 else 8)}
        w0 = state["w"].clone()
        _step, error = try_restore(topo, state)
    assert allgather(error_summary(error)) == [error_summary(error)] * 4
    assert isinstance(error, StateMismatchError), error
    assert "model/weight: checkpoint has float32 [8, 4], the state has float32 [3, 4]" in str(error)
    assert tree_digest(ftkit_env.local_dir) == before
    assert torch.equal(state["w"], w0)                 # nothing was loaded, anywhere


def test_newer_unusable_steps_are_parked_after_a_pfs_restore(ftkit_env):
    """local:1,pfs:2: local steps 2 and 3 of rank 1 corrupted; restore takes PFS step 2,
    parks local step 3 (committed, unusable) instead of deleting it, saves step 3 again, and
    the parked copy goes at the first retention after the new step 3 is committed."""
    levels = "local:1,pfs:2"
    with topology() as topo:
        save_steps(topo, [1, 2, 3], levels=levels)
        if RANK == 0:       # as if killed before close() flushed its final step 3
            shutil.rmtree(ftkit_env.pfs_dir / ftkit_env.job / "step-3")
        if RANK == 1:
            for s in (2, 3):
                flip_byte(ftkit_env.step_dir(0, s) / "rank-1.ftk")
        WORLD.Barrier()
        state = small_state(RANK, 0)
        ckpt = Checkpointer(topo, Config.load(async_=False, levels=levels))
        step = ckpt.restore(state)
        parked = sorted(p.name for p in ftkit_env.node_dir(RANK // 2).iterdir()
                        if p.name.startswith("parked-"))
        WORLD.Barrier()
        ckpt.save(3, small_state(RANK, 3))
        kept = sorted(p.name for p in ftkit_env.node_dir(RANK // 2).iterdir()
                      if p.name.startswith("parked-"))
        WORLD.Barrier()      # the node leader's save(4) retains before its first collective
        ckpt.save(4, small_state(RANK, 4))        # retention after step 3's commit
        after = sorted(p.name for p in ftkit_env.node_dir(RANK // 2).iterdir()
                       if p.name.startswith("parked-"))
        ckpt.close()
    assert allgather(step) == [2] * 4
    assert allgather(diff(canon(small_state(RANK, 2)), canon(state))) == [[]] * 4
    assert allgather(parked) == [["parked-step-3"]] * 4
    assert allgather(kept) == [["parked-step-3"]] * 4    # until step 3 is committed again
    assert allgather(after) == [[]] * 4


def test_flush_failure_is_agreed_everywhere_and_raised_nowhere(ftkit_env):
    """A flush that fails on one rank fails on every rank with the same reason
    (``pfs_failures``), no rank raises it from any save or from close, and the later steps
    reach the PFS."""
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=True, levels="local:1,pfs:1",
                                              faults="raise:rank=1:step=1:phase=flush"))
        raised = []
        for s in (1, 2, 3, 4):
            error = catch(ckpt.save, s, small_state(RANK, s))
            if error is not None:
                raised.append((s, error_summary(error)))
        error = catch(ckpt.close)
        if error is not None:
            raised.append(("close", error_summary(error)))
        assert allgather(raised) == [[]] * 4
        failures = dict(ckpt.pfs_failures)
        flushed = ckpt.last_flushed
    assert allgather(failures) == [failures] * 4
    assert list(failures) == [1] and "rank 1: InjectedFault" in failures[1], failures
    assert allgather(flushed) == [4] * 4


def test_final_load_verifies_what_it_loads(ftkit_env, monkeypatch):
    """Discovery's full check is bypassed; the load itself must catch the flipped byte."""
    with topology() as topo:
        save_steps(topo, [1])
        if RANK == 3:
            flip_byte(ftkit_env.step_dir(1, 1) / "rank-3.ftk")
        WORLD.Barrier()
        monkeypatch.setattr(Shard, "check", classmethod(lambda cls, *a, **k: None))
        _step, error = try_restore(topo, small_state(RANK, 0))
    assert allgather(error_summary(error)) == [error_summary(error)] * 4
    assert error is not None and "checksum mismatch" in str(error), error
    assert "rank-3.ftk" in str(error)
    assert os.path.exists(ftkit_env.step_dir(1, 1) / "rank-3.ftk")
