"""Hostile node-local shards on 4 ranks / 2 virtual nodes: a shard whose header checksum and
tensor checksums are all consistent but which does not decode (crafted header) makes its
step unusable on every rank with a one-line reason, and restore loads the older step; a
decoding failure of the final load (after discovery agreed on a step) does the same;
nothing is deleted.

A rank only touches files in its own node's directory (rank 1 and rank 3 own theirs).
"""
from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xxhash

from ftkit import Checkpointer, Config
from ftkit.faults import flip_byte
from ftkit.recovery import restore as recovery
from ftkit.storage.shard import MAGIC, VERSION

from .mpi_helpers import (
    RANK,
    WORLD,
    allgather,
    canon,
    catch,
    diff,
    events,
    save_steps,
    small_state,
    topology,
)


def craft(path: Path, mutate: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite the header of shard ``path`` with ``mutate`` applied, header checksum
    recomputed (padded with spaces to its old length, so every tensor stays in place and
    every tensor checksum still holds)."""
    data = path.read_bytes()
    hlen = struct.unpack_from("<I", data, 12)[0]
    header = json.loads(data[24:24 + hlen])
    mutate(header)
    head = json.dumps(header, separators=(",", ":")).encode()
    assert len(head) <= hlen, "a crafted header must not grow"
    head += b" " * (hlen - len(head))
    path.write_bytes(struct.pack("<8sIIQ", MAGIC, VERSION, hlen,
                                 xxhash.xxh3_64_intdigest(head)) + head + data[24 + hlen:])


def _index_out_of_range(h: dict[str, Any]) -> None:
    next(node for key, node in h["tree"]["items"] if key == "w")["i"] = 9


def _object_dtype(h: dict[str, Any]) -> None:
    next(t for t in h["tensors"] if t["path"] == "np")["dtype"] = "|O"


def _shape_mismatch(h: dict[str, Any]) -> None:
    next(t for t in h["tensors"] if t["path"] == "w")["shape"] = [4095]


CRAFTS = {"index-out-of-range": _index_out_of_range, "object-dtype": _object_dtype,
          "shape-mismatch": _shape_mismatch}


def step_files(local_dir: Path) -> dict[str, str]:
    """Every file of every (parked) step directory: relative path -> sha256, as rank 0 sees
    it, on every rank."""
    listing = None
    if RANK == 0:
        listing = {str(p.relative_to(local_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
                   for p in sorted(local_dir.rglob("*"))
                   if p.is_file() and "step-" in str(p.relative_to(local_dir))}
    return WORLD.bcast(listing, root=0)


def restore_fresh(topo: Any, **overrides: Any) -> tuple[int, dict[str, Any]]:
    state = small_state(RANK, 0)
    ckpt = Checkpointer(topo, Config.load(**overrides))
    step = ckpt.restore(state)
    ckpt.close()
    return step, state


def one_skip(events_path: Path, step: int, rank: int) -> str:
    """The reason of the only ``restore-skip`` event, for ``step``, failed on ``rank``."""
    skips = [e for e in events(events_path) if e["event"] == "restore-skip"]
    assert [(e["step"], list(e["failures"])) for e in skips] == [(step, [str(rank)])], skips
    why = skips[0]["failures"][str(rank)]
    assert "\n" not in why and "\n" not in skips[0]["reason"], skips[0]
    return why


@pytest.mark.parametrize("how", sorted(CRAFTS))
def test_undecodable_newest_shard_falls_back(ftkit_env, how):
    """Rank 1's step-2 shard is consistent (checksums hold) but does not decode: every rank
    agrees step 2 is unusable and loads step 1; step 2 is parked, not deleted."""
    with topology() as topo:
        expected = save_steps(topo, [1, 2])
        if RANK == 1:
            craft(ftkit_env.step_dir(0, 2) / "rank-1.ftk", CRAFTS[how])
        WORLD.Barrier()
        before = step_files(ftkit_env.local_dir)
        step, state = restore_fresh(topo)
    assert allgather(step) == [1] * 4
    assert allgather(diff(expected[1], canon(state))) == [[]] * 4
    why = one_skip(ftkit_env.events_path, 2, 1)
    assert "rank-1.ftk" in why and "rank 1" in why and "step 2" in why, why
    restores = [e for e in events(ftkit_env.events_path) if e["event"] == "restore"]
    assert [(e["step"], e["skipped"]) for e in restores] == [(1, [2])]
    parked = {k.replace("/step-2/", "/parked-step-2/"): v for k, v in before.items()}
    assert step_files(ftkit_env.local_dir) == parked      # moved aside, byte for byte


@pytest.mark.parametrize("damage", ["undecodable", "flipped"])
def test_damaged_shard_is_rebuilt_from_its_partner_copy(ftkit_env, damage):
    """With a partner level the damaged shard is lost like any other: it is rebuilt from
    the (intact) partner copy and step 2 is restored. An undecodable header is found by
    discovery; a flipped data byte by the load (discovery reads headers only), after the
    live tensors took some of step 2's bytes: step 2 is then looked at again with every
    byte, rebuilt and loaded again, and nothing is skipped."""
    levels = "local:1,partner:1"
    with topology() as topo:
        expected = save_steps(topo, [1, 2], levels=levels)
        if RANK == 1:
            shard = ftkit_env.step_dir(0, 2) / "rank-1.ftk"
            if damage == "undecodable":
                craft(shard, _index_out_of_range)
            else:
                flip_byte(shard)
        WORLD.Barrier()
        step, state = restore_fresh(topo, levels=levels)
    assert allgather(step) == [2] * 4
    assert allgather(diff(expected[2], canon(state))) == [[]] * 4
    evs = events(ftkit_env.events_path)
    assert [e["ranks"] for e in evs if e["event"] == "rebuild"] == [[1]], evs
    assert not [e for e in evs if e["event"] == "restore-skip"], evs


def _discover(ckpt: Checkpointer, topo: Any) -> recovery.Discovery:
    return ckpt.restorer.discover(run_id=ckpt.run_id, rank_node=list(topo.rank_node))


def test_final_load_failure_falls_back_to_the_older_step(ftkit_env):
    """Discovery agrees on step 2; then rank 1's shard is damaged before the final load.
    The load fails on rank 1 only, every rank marks step 2 unusable (restore-skip) and the
    next attempt loads step 1 everywhere."""
    with topology() as topo:
        expected = save_steps(topo, [1, 2])
        state = small_state(RANK, 0)
        ckpt = Checkpointer(topo, Config.load())
        found = _discover(ckpt, topo)
        first = found.step
        if RANK == 1:
            flip_byte(ftkit_env.step_dir(0, 2) / "rank-1.ftk")
        WORLD.Barrier()
        loaded = ckpt.restorer.try_load(found, state)
        second = found.step
        again = ckpt.restorer.try_load(found, state)
        skipped = dict(found.skipped)
        ckpt.close()
    assert allgather((first, loaded, second, again)) == [(2, False, 1, True)] * 4
    assert allgather(diff(expected[1], canon(state))) == [[]] * 4
    assert allgather(sorted(skipped)) == [[2]] * 4
    why = one_skip(ftkit_env.events_path, 2, 1)
    assert "rank-1.ftk" in why and "checksum mismatch" in why, why
    assert (ftkit_env.step_dir(0, 2) / "rank-1.ftk").is_file()


def test_final_load_failure_of_the_only_step_names_it(ftkit_env):
    """Nothing older to fall back to: the attempt leaves no usable step, and the error
    restore raises then names the step, the rank's file and the reason; nothing deleted."""
    with topology() as topo:
        save_steps(topo, [1])
        state = small_state(RANK, 0)
        before = canon(state)
        ckpt = Checkpointer(topo, Config.load())
        found = _discover(ckpt, topo)
        if RANK == 3:
            flip_byte(ftkit_env.step_dir(1, 1) / "rank-3.ftk")
        WORLD.Barrier()
        files = step_files(ftkit_env.local_dir)
        loaded = ckpt.restorer.try_load(found, state)
        error = str(recovery.unrecoverable_error(found, ckpt.local.root.parent, {}))
        ckpt.close()
    assert allgather((loaded, found.step, error)) == [(False, 0, error)] * 4
    for needle in ("step 1", "rank 3", "rank-3.ftk", "checksum mismatch", "Nothing was deleted"):
        assert needle in error, (needle, error)
    assert step_files(ftkit_env.local_dir) == files
    # the load read straight into the live tensors, so they may hold step 1's bytes (and
    # rank 3 the damaged ones): such a state is never handed back, restore raises
    assert allgather(diff(before, canon(state)) != []) == [True] * 4
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load())
        error2 = catch(ckpt.restore, small_state(RANK, 0))
        ckpt.close()
    assert allgather(type(error2).__name__) == ["UnrecoverableError"] * 4
