"""The PFS level's files on 4 ranks / 2 virtual nodes: every rank writes its own
``rank-<r>.h5`` from its node-local shard; each node leader writes ``node-<id>.h5`` holding
only external links to its ranks' files; the index links the node files; ``COMMITTED`` has a
digest of every file. Read back through the index by ftkit and by plain h5py."""
from __future__ import annotations

import shutil

import h5py

from ftkit import Checkpointer, Config
from ftkit.storage.pfs import hdf5
from ftkit.storage.pfs.h5read import StepReader

from .mpi_helpers import RANK, WORLD, assert_restores, small_state, topology


def test_every_rank_writes_its_own_file(ftkit_env) -> None:
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(levels="local:1,pfs:1"))
        ckpt.save(3, small_state(RANK, 3))
        ckpt.close()
        step_dir = ftkit_env.pfs_dir / ftkit_env.job / "step-3"
        WORLD.Barrier()
        with StepReader(step_dir, 3, require_commit=True) as reader:
            group, _ = reader.read(RANK)
            files = sorted(reader.digests or {})
        assert group.file == str(step_dir / f"rank-{RANK}.h5")
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
        WORLD.Barrier()
        if topo.is_node_leader:
            shutil.rmtree(ftkit_env.node_dir(topo.node))     # restore from the PFS
        WORLD.Barrier()
        assert_restores(topo, 3, "local:1,pfs:1")
