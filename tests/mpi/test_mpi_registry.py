"""A storage level is one module plus one registry entry: a toy redundancy level registered
here (not in ftkit) is configured, saved by the two-phase protocol, planned and rebuilt at
restore like the built-in ones, on 4 ranks / 2 virtual nodes.

The toy ``twin`` level keeps a second copy of each rank's shard in the same node-local step
directory: it survives a damaged shard (not a lost node).
"""
from __future__ import annotations

import shutil
from collections.abc import Sequence
from typing import Any

from ftkit import Checkpointer, Config
from ftkit.faults import flip_byte
from ftkit.storage import registry
from ftkit.storage.level import Cover, Redundancy, Report
from ftkit.storage.local import LocalLevel
from ftkit.storage.shard import Shard
from ftkit.storage.site import Site

from .mpi_helpers import (
    RANK,
    WORLD,
    allgather,
    canon,
    diff,
    events,
    save_steps,
    small_state,
    topology,
)


class TwinCover(Cover):
    name = "twin"
    kind = "copy"

    def solve(self, reports: Sequence[Report], have: list[bool],
              node_name: Sequence[str]) -> tuple[list[int], list[str]]:
        part, why = [], []
        for r in (r for r, ok in enumerate(have) if not ok):
            state = reports[r].get(self.name, "missing")
            if state is None:
                part.append(r)
                have[r] = True
            else:
                why.append(f"twin: rank {r}'s twin is {state}")
        return part, why

    def rebuilt(self, part: list[int]) -> list[int]:
        return list(part)


class TwinLevel(Redundancy):
    name = "twin"
    cover = TwinCover()

    def __init__(self, local: LocalLevel) -> None:
        self.local = local

    @classmethod
    def build(cls, site: Site) -> TwinLevel:
        return cls(site.local)

    def path(self, step: int) -> Any:
        return self.local.step_dir(step) / f"twin-{self.local.rank}.ftk"

    def encode(self, step: int) -> None:
        shutil.copyfile(self.local.shard_path(step), self.path(step))

    def discard(self, step: int) -> None:
        if not self.local.is_committed(step):
            self.path(step).unlink(missing_ok=True)

    def held(self, step: int, world: int, *, data: bool = True) -> str | None:
        if not self.path(step).is_file():
            return "missing"
        Shard.check(self.path(step), rank=self.local.rank, step=step, world=world,
                    level=self.name, data=data)
        return None

    def unusable(self, why: str) -> str:
        return why

    def rebuild(self, step: int, part: Any, reports: Sequence[Report],
                have: Sequence[bool]) -> None:
        if self.local.rank in part:
            shutil.copyfile(self.path(step), self.local.shard_path(step))

    def free(self) -> None:
        pass


registry.register("twin", TwinLevel.build)
LEVELS = "local:1,twin:1"


def test_a_registered_level_is_saved_planned_and_rebuilt(ftkit_env):
    with topology() as topo:
        expected = save_steps(topo, [1, 2], levels=LEVELS)
        shard = ftkit_env.step_dir(RANK // 2, 2) / f"rank-{RANK}.ftk"
        assert (shard.parent / f"twin-{RANK}.ftk").read_bytes() == shard.read_bytes()
        if RANK == 3:
            flip_byte(shard)
        WORLD.Barrier()
        ckpt = Checkpointer(topo, Config.load(levels=LEVELS))
        state = small_state(RANK, 0)
        step = ckpt.restore(state)
        ckpt.close()
    assert allgather(step) == [2] * 4
    assert allgather(diff(expected[2], canon(state))) == [[]] * 4
    rebuilds = [e for e in events(ftkit_env.events_path) if e["event"] == "rebuild"]
    assert [(e["step"], e["ranks"], e["by_level"]) for e in rebuilds] == \
        [(2, [3], {"twin": [3]})], rebuilds


def test_a_registered_level_that_cannot_rebuild_is_named(ftkit_env):
    """Rank 3's shard and twin of step 2 are both damaged: step 2 is skipped with the twin's
    reason, step 1 restored."""
    with topology() as topo:
        expected = save_steps(topo, [1, 2], levels=LEVELS)
        step_dir = ftkit_env.step_dir(RANK // 2, 2)
        if RANK == 3:
            flip_byte(step_dir / "rank-3.ftk")
            flip_byte(step_dir / "twin-3.ftk")
        WORLD.Barrier()
        state = small_state(RANK, 0)
        ckpt = Checkpointer(topo, Config.load(levels=LEVELS))
        step = ckpt.restore(state)
        ckpt.close()
    assert allgather(step) == [1] * 4
    assert allgather(diff(expected[1], canon(state))) == [[]] * 4
    [skip] = [e for e in events(ftkit_env.events_path) if e["event"] == "restore-skip"]
    assert skip["step"] == 2 and "level twin" in skip["reason"], skip
    assert "twin: rank 3's twin is" in skip["reason"] and "twin-3.ftk" in skip["reason"], skip
