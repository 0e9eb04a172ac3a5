"""The PFS level's files on 4 ranks / 2 virtual nodes: every rank writes its own
``rank-<r>.h5`` from its node-local shard; each node leader writes ``node-<id>.h5`` holding
only external links to its ranks' files; the index links the node files; ``COMMITTED`` has a
digest of every file. Read back through the index by ftkit and by plain h5py."""
from __future__ import annotations

import h5py
import pytest

from ftkit import Checkpointer, Config
from ftkit.storage.pfs import hdf5

from .mpi_helpers import (
    RANK,
    WORLD,
    allgather,
    assert_restores_from_pfs,
    flushed_step,
    small_state,
    topology,
)
from .test_mpi_pfs_degrade import tmp_files


def test_every_rank_writes_its_own_file(ftkit_env) -> None:
    with topology() as topo:
        step_dir, group_file, files = flushed_step(ftkit_env, topo, 3)
        assert group_file == str(step_dir / f"rank-{RANK}.h5")
        assert files == ["ftkit.h5", "node-0.h5", "node-1.h5",
                         "rank-0.h5", "rank-1.h5", "rank-2.h5", "rank-3.h5"], files
        record = hdf5.read_commit(step_dir, 3)
        assert record["files"][f"node-{topo.node}.h5"]["raw"] == []      # links only
        with h5py.File(step_dir / f"node-{topo.node}.h5", "r") as h5:
            link = h5["rank"].get(str(RANK), getlink=True)
            assert isinstance(link, h5py.ExternalLink), link
            assert (link.filename, link.path) == (f"rank-{RANK}.h5", f"/rank/{RANK}")
        with h5py.File(step_dir / "ftkit.h5", "r") as h5:            # plain h5py, two hops
            assert int(h5[f"rank/{RANK}"].attrs["rank"]) == RANK
        assert_restores_from_pfs(ftkit_env, topo, 3)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_each_rank_file_is_its_early_write(ftkit_env, async_: bool) -> None:
    """Steps due at ``local`` and ``pfs``: every rank's file of every step is the one it
    wrote while the capture filled its slot, renamed into place by the step's flush (async:
    each flush finished before the next capture, so every capture finds no flush running);
    the newest step restores bit-exact from the PFS; no temp file is left."""
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=async_, levels="local:1,pfs:1"))
        for step in (1, 2, 3):
            ckpt.save(step, small_state(RANK, step))
            ckpt.wait()
        ckpt.close()
        assert allgather(ckpt.pfs.adopted) == [[1, 2, 3]] * WORLD.size
        assert tmp_files(ftkit_env.pfs_dir) == []
        assert_restores_from_pfs(ftkit_env, topo, 3)
