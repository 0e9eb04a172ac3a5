"""After a rebuild only what the loss took is protected again (4 ranks, 2 virtual nodes): the
partner copies and the parity the lost node held — and the step then survives the loss of
the *other* node too. A shard lost alone (its copies and parity intact) moves nothing else.
"""
from __future__ import annotations

from typing import Any

from ftkit import Checkpointer, Config
from ftkit.faults import flip_byte

from .mpi_helpers import (
    RANK,
    WORLD,
    allgather,
    canon,
    diff,
    events,
    lose_node,
    save_steps,
    small_state,
    topology,
)


def _restore(topo: Any, **config: Any) -> tuple[int, Any]:
    state = small_state(RANK, 0)
    ckpt = Checkpointer(topo, Config.load(**config))
    step = ckpt.restore(state)
    ckpt.close()
    return step, canon(state)


def _rebuilds(ftkit_env: Any) -> list[tuple[int, list[int], list[str]]]:
    return [(e["step"], e["ranks"], e["reprotected"]) for e in events(ftkit_env.events_path)
            if e["event"] == "rebuild"]


def test_partner_copies_of_the_lost_node_are_sent_again(ftkit_env):
    """Node 0 held the copies of ranks 2 and 3: only those are sent again, and the step then
    survives the loss of node 1 (rebuilt from those fresh copies)."""
    config = {"levels": "local:1,partner:1"}
    with topology() as topo:
        expected = save_steps(topo, [1], **config)
        lose_node(ftkit_env, 0)
        first = _restore(topo, **config)
        lose_node(ftkit_env, 1)
        second = _restore(topo, **config)
    for step, state in (first, second):
        assert allgather(step) == [1] * 4
        assert allgather(diff(expected[1], state)) == [[]] * 4
    assert _rebuilds(ftkit_env) == [
        (1, [0, 1], ["partner: copies of ranks [2, 3] sent again"]),
        (1, [2, 3], ["partner: copies of ranks [0, 1] sent again"])]


def test_parity_of_the_sets_that_lost_a_member_is_encoded_again(ftkit_env):
    config = {"levels": "local:1,xor:1", "xor_set": 2}
    with topology() as topo:
        expected = save_steps(topo, [1], **config)
        lose_node(ftkit_env, 1)
        first = _restore(topo, **config)
        lose_node(ftkit_env, 0)
        second = _restore(topo, **config)
    for step, state in (first, second):
        assert allgather(step) == [1] * 4
        assert allgather(diff(expected[1], state)) == [[]] * 4
    assert _rebuilds(ftkit_env) == [
        (1, [2, 3], ["xor: parity of sets [0, 1] encoded again"]),
        (1, [0, 1], ["xor: parity of sets [0, 1] encoded again"])]


def test_a_shard_lost_alone_moves_nothing_else(ftkit_env):
    """Rank 3's own shard is damaged, its node's copies and parity are intact: it is rebuilt
    and nothing is sent or encoded again."""
    config = {"levels": "local:1,partner:1,xor:1", "xor_set": 2}
    with topology() as topo:
        expected = save_steps(topo, [1], **config)
        if RANK == 3:
            flip_byte(ftkit_env.step_dir(1, 1) / "rank-3.ftk")
        WORLD.Barrier()
        step, state = _restore(topo, **config)
    assert allgather(step) == [1] * 4
    assert allgather(diff(expected[1], state)) == [[]] * 4
    assert _rebuilds(ftkit_env) == [(1, [3], [])]
