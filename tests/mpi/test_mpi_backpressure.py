"""Back-pressure on the PFS level (4 ranks / 2 virtual nodes, async, ``local:1,pfs:1``):
training never waits for a flush. The flush of step 1 is held (on every rank, released only
after step 3 was decided); steps 2 and 3 still commit without waiting for it: step 2's flush
is delayed, then skipped when step 3 is due (step 3 delayed in turn); ``wait()`` flushes
step 3 once step 1's flush is done. Events ``flush-delayed`` and ``flush-skipped`` say so."""
from __future__ import annotations

import threading
from typing import Any

from ftkit import Checkpointer, Config
from ftkit.storage.pfs.level import PfsLevel

from .mpi_helpers import RANK, assert_restores, events, small_state, topology
from .test_mpi_pfs_degrade import committed_pfs_steps

HOLD_S = 120.0           # a flush that is never released fails the test, it does not hang


def test_a_running_flush_delays_then_skips_newer_steps(ftkit_env, monkeypatch) -> None:
    release = threading.Event()
    real_flush = PfsLevel.flush

    def held_flush(self: PfsLevel, step: int, **kw: Any) -> float:
        if step == 1:
            assert release.wait(HOLD_S), "the flush of step 1 was never released"
        return real_flush(self, step, **kw)
    monkeypatch.setattr(PfsLevel, "flush", held_flush)
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=True, levels="local:1,pfs:1"))
        real_schedule = ckpt.flushes.schedule
        decided = []

        def schedule(due: int | None, busy: bool) -> None:
            real_schedule(due, busy)
            decided.append((due, busy))
            if due == 3:
                release.set()          # step 3 was decided while step 1's flush was held
        monkeypatch.setattr(ckpt.flushes, "schedule", schedule)
        for step in (1, 2, 3):
            ckpt.save(step, small_state(RANK, step))     # returns with step 1's flush held
        ckpt.wait()
        ckpt.close()
        assert decided == [(1, False), (2, True), (3, True)], decided
        pfs_job = ftkit_env.pfs_dir / ftkit_env.job
        assert committed_pfs_steps(pfs_job) == [1, 3]
        log = [(e["event"], e["step"], e.get("superseded_by"))
               for e in events(ftkit_env.events_path)
               if e["event"] in ("flush", "flush-delayed", "flush-skipped")]
        assert log == [("flush-delayed", 2, None), ("flush-skipped", 2, 3),
                       ("flush-delayed", 3, None), ("flush", 1, None),
                       ("flush", 3, None)], log
        assert [e["step"] for e in events(ftkit_env.events_path)
                if e["event"] == "commit"] == [1, 2, 3]
        assert_restores(topo, 3, "local:1,pfs:1")
