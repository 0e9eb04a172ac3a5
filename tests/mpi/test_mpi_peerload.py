"""A lost node's ranks load their shards straight from the partner copies on the other node
into their live state (4 ranks, 2 virtual nodes), and the step is repaired after the load:
the lost shards are written to their node again and the copies the node held are sent again.
A copy damaged at rest is caught as it lands and the restore falls back to an older step.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ftkit import Checkpointer, Config
from ftkit.comm.dist import DistComm
from ftkit.errors import CorruptCheckpointError
from ftkit.faults import flip_byte
from ftkit.storage.redundancy import erasure
from ftkit.storage.redundancy.fetch import CopySend, RemoteShard

from .mpi_helpers import (
    RANK,
    WORLD,
    allgather,
    canon,
    catch,
    diff,
    events,
    lose_node,
    save_steps,
    small_state,
    topology,
)

CONFIG = {"levels": "local:1,partner:1"}


def _of(ftkit_env: Any, name: str) -> list[dict[str, Any]]:
    return [e for e in events(ftkit_env.events_path) if e["event"] == name]


def _lose_twice(ftkit_env: Any, topo: Any, config: dict[str, Any], first: Any, second: Any,
                *, async_: bool = True, node: int = 0) -> list[str]:
    """Save step 1, call ``first`` (a loss), restore and wait for the repair, call
    ``second`` (another loss), restore again: both restores are step 1, bit-exact, on every rank. Returns
    the ``*.ftk`` files on ``node``'s step 1 after the first repair. All ranks call."""
    expected = save_steps(topo, [1], **config)
    first()
    state = small_state(RANK, 0)
    ckpt = Checkpointer(topo, Config.load(async_=async_, **config))
    step = ckpt.restore(state)
    ckpt.wait()
    files = sorted(p.name for p in ftkit_env.step_dir(node, 1).glob("*.ftk"))
    ckpt.close()
    second()
    again = small_state(RANK, 0)
    ckpt = Checkpointer(topo, Config.load(**config))
    step_again = ckpt.restore(again)
    ckpt.close()
    assert allgather(step) == [1] * 4 and allgather(step_again) == [1] * 4
    assert allgather(diff(expected[1], canon(state))) == [[]] * 4
    assert allgather(diff(expected[1], canon(again))) == [[]] * 4
    return files


def _falls_back(ftkit_env: Any, topo: Any, config: dict[str, Any], lose: Any, damage: Any
                ) -> dict[str, Any]:
    """Save steps 1 and 2, call ``lose`` and ``damage`` (step 2's redundancy), restore: step
    1, bit-exact, on every rank; returns the one ``restore-skip`` event. All ranks call."""
    expected = save_steps(topo, [1, 2], **config)
    lose()
    damage()
    WORLD.Barrier()
    state = small_state(RANK, 0)
    ckpt = Checkpointer(topo, Config.load(**config))
    step = ckpt.restore(state)
    ckpt.close()
    assert allgather(step) == [1] * 4
    assert allgather(diff(expected[1], canon(state))) == [[]] * 4
    [skip] = _of(ftkit_env, "restore-skip")
    return skip


@pytest.mark.parametrize("async_", [True, False])
def test_lost_ranks_load_from_the_partner_copies(ftkit_env, async_):
    """Ranks 0 and 1 (node 0, directory gone) load step 1 from their copies on node 1 (the
    restore event names whose); after the repair (in restore when saves are synchronous,
    else once the checkpoint thread is waited for) node 0 holds their shards and the copies
    of ranks 2 and 3 again, bit-exact: the step then survives losing node 1."""
    with topology() as topo:
        partners = topo.partner_map()
        on_node0 = _lose_twice(ftkit_env, topo, CONFIG, lambda: lose_node(ftkit_env, 0),
                               lambda: lose_node(ftkit_env, 1), async_=async_)
    assert on_node0 == ["partner-2.ftk", "partner-3.ftk", "rank-0.ftk", "rank-1.ftk"]
    restores = _of(ftkit_env, "restore")
    assert restores[0]["loaded_from"] == {"0": partners[0], "1": partners[1]}, restores
    assert restores[1]["loaded_from"] == {"2": partners[2], "3": partners[3]}, restores
    rebuilds = _of(ftkit_env, "rebuild")
    assert [(e["ranks"], e["loaded_from"], e["reprotected"]) for e in rebuilds] == [
        ([0, 1], {"0": partners[0], "1": partners[1]},
         ["partner: copies of ranks [2, 3] sent again"]),
        ([2, 3], {"2": partners[2], "3": partners[3]},
         ["partner: copies of ranks [0, 1] sent again"])]


@pytest.mark.parametrize("levels", ["local:1,xor:1", "local:1,rs:1"])
def test_lost_members_are_decoded_straight_into_their_state(ftkit_env, levels):
    """Sets {0, 2} and {1, 3} (XOR, or RS with one parity: a plain XOR too): node 1's ranks
    decode their shards from their sets as the pieces stream in (the restore event names
    the sets), bit-exact; the repair then writes the shards and parity on node 1 again, so
    the step survives losing node 0 next."""
    name = levels.split(",")[1].split(":")[0]
    config = {"levels": levels, "xor_set": 2, "rs_set": 2, "rs_parity": 1}
    with topology() as topo:
        on_node1 = _lose_twice(ftkit_env, topo, config, lambda: lose_node(ftkit_env, 1),
                               lambda: lose_node(ftkit_env, 0), node=1)
    assert on_node1 == sorted([f"{name}-0-1.ftk", f"{name}-1-1.ftk", "rank-2.ftk", "rank-3.ftk"])
    restores = _of(ftkit_env, "restore")
    assert restores[0]["loaded_from"] == {"2": f"{name} set 0", "3": f"{name} set 1"}
    assert restores[1]["loaded_from"] == {"0": f"{name} set 0", "1": f"{name} set 1"}


def test_a_copy_damaged_at_rest_is_caught_as_it_lands(ftkit_env):
    """Step 2's copy of rank 0 has a flipped byte in a tensor (discovery reads headers only):
    rank 0's load from it fails its checksum, every rank agrees, the step is looked at
    again with every byte and skipped, and step 1 is loaded from the copies, bit-exact."""
    def damage() -> None:
        if RANK == partners[0]:
            flip_byte(ftkit_env.step_dir(1, 2) / "partner-0.ftk")

    with topology() as topo:
        partners = topo.partner_map()
        skip = _falls_back(ftkit_env, topo, CONFIG, lambda: lose_node(ftkit_env, 0), damage)
    assert skip["step"] == 2 and "partner" in skip["reason"] and "rank 0" in skip["reason"], skip
    assert _of(ftkit_env, "restore")[0]["loaded_from"] == {"0": partners[0], "1": partners[1]}


def _two_ranks(fn: Any) -> None:
    """Run ``fn(dc)`` on ranks 0 and 1 over a communicator of their own."""
    sub = WORLD.Split(0 if RANK < 2 else 1, RANK)
    try:
        if RANK < 2:
            fn(DistComm(sub, 20.0))
    finally:
        sub.Free()
        WORLD.Barrier()


def test_a_copy_that_cannot_be_opened_fails_its_rank_at_once(ftkit_env, tmp_path):
    """The holder's copy is not there: it raises, and the receiving rank learns it at once
    (not after FTKIT_TIMEOUT) with an error naming the holder."""
    errors: list[Any] = []

    def run(dc: DistComm) -> None:
        if dc.rank == 0:
            send = CopySend(Path(tmp_path) / "gone.ftk", 1, 77, step=3, level="partner")
            errors.append(catch(send.post, dc.comm))
            send.finish(dc, False)
        else:
            t0 = time.monotonic()
            errors.append(catch(RemoteShard.receive, dc, 0, 77, path=Path("copy"), rank=1,
                                step=3, world=2, level="partner"))
            errors.append(time.monotonic() - t0)
    _two_ranks(run)
    if RANK == 0:
        assert isinstance(errors[0], CorruptCheckpointError) and "gone.ftk" in str(errors[0])
    elif RANK == 1:
        err, seconds = errors
        assert isinstance(err, CorruptCheckpointError), err
        assert "sent by rank 0" in str(err) and "could not send" in str(err), err
        assert seconds < 10, seconds


def test_a_remote_shard_reads_tensors_into_place_and_checks_them(ftkit_env, tmp_path):
    """Rank 0 sends a shard file it holds; rank 1 reads the header and each tensor into
    arrays of its own: equal bytes, and a byte flipped in the sender's file makes that
    tensor's read return False (the next one still reads)."""
    from ftkit.capture.flatten import flatten
    from ftkit.storage.shard import Shard, write_shard

    state = {"a": np.arange(300_000, dtype=np.float32), "b": np.arange(7, dtype=np.int64)}
    results: list[Any] = []

    def run(dc: DistComm) -> None:
        path = Path(tmp_path) / "copy.ftk"
        if dc.rank == 0:
            tree, leaves = flatten(state)
            write_shard(path, {"rank": 1, "step": 5, "world": 2}, tree, leaves,
                        [lf.source.view(np.uint8) for lf in leaves])
            with Shard.open(path) as shard:
                a = shard.tensors[0]["offset"]
            flip_byte(path, a + 100)
            for tag in (5, 6):
                send = CopySend(path, 1, tag, step=5, level="partner")
                send.post(dc.comm)
                dc.barrier("test")
                send.finish(dc, True)
        else:
            for tag in (5, 6):
                remote = RemoteShard.receive(dc, 0, tag, path=Path("copy"), rank=1, step=5,
                                             world=2, level="partner")
                outs = [np.empty(t["nbytes"], np.uint8) for t in remote.tensors]
                results.append([remote.read_into(i, o) for i, o in enumerate(outs)])
                dc.barrier("test")
            results.append(outs)
    _two_ranks(run)
    if RANK == 1:
        oks, _, outs = results
        assert oks == [False, True], oks
        got = outs[0].view(np.float32)
        assert np.count_nonzero(got != state["a"]) == 1
        assert np.array_equal(outs[1].view(np.int64), state["b"])


def test_damaged_parity_fails_the_streamed_load_and_the_older_step_is_used(ftkit_env):
    """Step 2's parity on node 0 has a flipped byte (discovery reads headers only): the
    lost members' streamed decode fails a tensor checksum, the step is looked at again with
    every byte and skipped (naming the parity), and step 1 is decoded, bit-exact."""
    config = {"levels": "local:1,xor:1", "xor_set": 2}

    def damage() -> None:
        if RANK == 0:
            for parity in ftkit_env.step_dir(0, 2).glob("xor-*.ftk"):
                flip_byte(parity)

    with topology() as topo:
        skip = _falls_back(ftkit_env, topo, config, lambda: lose_node(ftkit_env, 1), damage)
    assert skip["step"] == 2 and "xor" in skip["reason"], skip
    assert _of(ftkit_env, "restore")[0]["loaded_from"] == {"2": "xor set 0", "3": "xor set 1"}


def test_a_decoded_file_that_does_not_check_is_not_kept(ftkit_env, tmp_path):
    """A contributor's piece carries a flipped byte: the decoding rank receives everything
    (the contributor's sends complete), keeps nothing and raises, naming the file."""
    from ftkit.capture.flatten import flatten
    from ftkit.storage.redundancy.decodeload import (
        DecodedSend,
        _Stream,
        pieces,
        receive_file,
    )
    from ftkit.storage.redundancy.transfer import StreamCheck, mapped
    from ftkit.storage.shard import write_shard
    from ftkit.storage.slots import Slots

    state = {"a": np.arange(700_000, dtype=np.float32)}
    outcome: list[Any] = []

    def run(dc: DistComm) -> None:
        src = Path(tmp_path) / "src.ftk"
        if dc.rank == 0:
            tree, leaves = flatten(state)
            write_shard(src, {"rank": 1, "step": 4, "world": 2}, tree, leaves,
                        [lf.source.view(np.uint8) for lf in leaves])
            flip_byte(src, src.stat().st_size - 5)
        size = dc.comm.bcast(src.stat().st_size if dc.rank == 0 else None, root=0)
        plan = pieces([((0, "d", 0, 1),)], -(-size // 64) * 64, size)
        if dc.rank == 0:
            with mapped(src) as view:
                send = DecodedSend(dc, 1, plan, 9, 4)
                send.post({("d", 0): view})
                send.finish(dc, True)
                outcome.append("sent")
        else:
            dest = Path(tmp_path) / "node" / "rank-1.ftk"
            dest.parent.mkdir()
            check = StreamCheck(dest, size, source=0, rank=1, step=4, world=None,
                                level="xor", counted=False)
            outcome.append(catch(receive_file, _Stream(dc, plan, {0: 9}, 4), size, dest,
                                 Slots(dest.parent, 1), check))
            outcome.append(sorted(p.name for p in dest.parent.iterdir()))
    _two_ranks(run)
    if RANK == 0:
        assert outcome == ["sent"]
    elif RANK == 1:
        err, names = outcome
        assert isinstance(err, CorruptCheckpointError) and "rank-1.ftk" in str(err), err
        assert "rank-1.ftk" not in names, names


@pytest.mark.parametrize("piece", [None, 4096])
def test_two_lost_members_are_decoded_from_reed_solomon_parity(ftkit_env, monkeypatch, piece):
    """One rank per node, one Reed-Solomon set of all 4 ranks with 2 parity: nodes 1 and 3
    lost, ranks 1 and 3 decode their shards straight into their state (GF(256) sums, not
    only XOR), bit-exact; after the repair the step survives losing nodes 0 and 2 too.
    ``piece``: the encode's ring moves its partial sums in pieces of 4 KiB (several per
    segment, the last one short) instead of one piece per segment."""
    if piece is not None:
        monkeypatch.setattr(erasure, "PIECE", piece)
    config = {"levels": "local:1,rs:1", "rs_set": 4, "rs_parity": 2}

    def lose(nodes: set[int]) -> None:
        WORLD.Barrier()
        if RANK in nodes:
            shutil.rmtree(ftkit_env.node_dir(RANK))
        WORLD.Barrier()

    with topology(ranks_per_node=1) as topo:
        _lose_twice(ftkit_env, topo, config, lambda: lose({1, 3}), lambda: lose({0, 2}))
    restores = _of(ftkit_env, "restore")
    assert restores[0]["loaded_from"] == {"1": "rs set 0", "3": "rs set 0"}, restores
    assert restores[1]["loaded_from"] == {"0": "rs set 0", "2": "rs set 0"}, restores


def test_members_of_different_sizes_encode_and_decode_in_pieces(ftkit_env, monkeypatch):
    """Reed-Solomon k=4 p=2 in pieces of 4 KiB over shards of very different sizes (rank
    0's holds 1 float, rank 3's 9001): the shorter members' segments end early, and the
    pieces past their end count as zeros in the encode and in the decode. Nodes 1 and 3
    lost: decoded straight into the state, bit-exact; after the repair nodes 0 and 2 lost:
    bit-exact again."""
    monkeypatch.setattr(erasure, "PIECE", 4096)
    config = {"levels": "local:1,rs:1", "rs_set": 4, "rs_parity": 2}

    def state(fill: float | None = None) -> dict[str, Any]:
        w = torch.arange(RANK * 3000 + 1, dtype=torch.float32) * 0.5 + RANK
        return {"w": w if fill is None else torch.full_like(w, fill)}

    def restore_after(nodes: set[int]) -> dict[str, Any]:
        WORLD.Barrier()
        if RANK in nodes:
            shutil.rmtree(ftkit_env.node_dir(RANK))
        WORLD.Barrier()
        got = state(fill=-1.0)
        ckpt = Checkpointer(topo, Config.load(**config))
        assert ckpt.restore(got) == 1
        ckpt.wait()
        ckpt.close()
        return got

    with topology(ranks_per_node=1) as topo:
        ckpt = Checkpointer(topo, Config.load(async_=False, **config))
        ckpt.save(1, state())
        ckpt.close()
        first, second = restore_after({1, 3}), restore_after({0, 2})
    assert allgather(bool(torch.equal(first["w"], state()["w"]))) == [True] * 4
    assert allgather(bool(torch.equal(second["w"], state()["w"]))) == [True] * 4
    restores = _of(ftkit_env, "restore")
    assert restores[0]["loaded_from"] == {"1": "rs set 0", "3": "rs set 0"}, restores
    assert restores[1]["loaded_from"] == {"0": "rs set 0", "2": "rs set 0"}, restores
