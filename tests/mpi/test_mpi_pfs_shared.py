"""``FTKIT_PFS_FILES=shared`` on 4 ranks / 2 virtual nodes: all ranks write one
``step-<s>/ranks.h5`` — rank 0 its metadata (every rank's groups and datasets), each rank its
own tensors' bytes at the offsets HDF5 allocated; the index links every ``/rank/<r>`` into
it; restore reads it back. A damaged shard, a damaged byte and a full PFS fail cleanly."""
from __future__ import annotations

import contextlib
import os
import shutil

import h5py
import numpy as np
import pytest
import torch

from ftkit import Checkpointer, Config
from ftkit.errors import CorruptCheckpointError
from ftkit.storage.pfs import hdf5
from ftkit.storage.pfs.h5read import StepReader
from tests.mounts import fill, tmpfs

from .mpi_helpers import (
    RANK,
    WORLD,
    allgather,
    assert_restores_from_pfs,
    catch,
    error_summary,
    flushed_step,
    small_state,
    topology,
)


def _listing(step_dir) -> list[str]:
    return sorted(p.name for p in step_dir.iterdir())


def test_all_ranks_write_one_shared_file(ftkit_env) -> None:
    with topology() as topo:
        step_dir, group_file, files = flushed_step(ftkit_env, topo, 3, pfs_files="shared")
        assert group_file == str(step_dir / "ranks.h5")
        assert files == ["ftkit.h5", "ranks.h5"], files
        assert _listing(step_dir) == ["COMMITTED", "ftkit.h5", "ranks.h5"]
        with h5py.File(step_dir / "ftkit.h5", "r") as h5:            # plain h5py, one hop
            link = h5["rank"].get(str(RANK), getlink=True)
            assert (link.filename, link.path) == ("ranks.h5", f"/rank/{RANK}")
            assert int(h5[f"rank/{RANK}"].attrs["rank"]) == RANK
        assert_restores_from_pfs(ftkit_env, topo, 3)


def test_large_tensors_land_aligned_and_bit_exact(ftkit_env) -> None:
    """Tensors of 64 KiB and more start at 4096-byte offsets of the shared file (written with
    O_DIRECT where the file system allows); they, small, scalar and empty tensors read back
    bit-exactly for every rank."""
    g = torch.Generator().manual_seed(RANK)
    state = {"big": torch.randn(3 * (1 << 20) // 4 + 5, generator=g),    # 3 pieces + a tail
             "small": torch.arange(7) + RANK, "scalar": torch.tensor(2.5 + RANK),
             "empty": torch.zeros(0, 3)}
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(levels="local:1,pfs:1", pfs_files="shared"))
        ckpt.save(1, state)
        ckpt.close()
    step_dir = ftkit_env.pfs_dir / ftkit_env.job / "step-1"
    WORLD.Barrier()
    with StepReader(step_dir, 1, require_commit=True) as reader:
        for rank in range(WORLD.size):
            group, arrays = reader.read(rank)
            want = torch.randn(state["big"].numel(), generator=torch.Generator().manual_seed(rank))
            i = group.entries.index(next(e for e in group.entries if e["path"] == "big"))
            assert np.array_equal(arrays[i].view(np.float32), want.numpy()), rank
            assert group.datasets[i].id.get_offset() % 4096 == 0
            by_path = {e["path"]: a for e, a in zip(group.entries, arrays)}
            assert by_path["scalar"].view(np.float32).tolist() == [2.5 + rank]
            assert by_path["small"].view(np.int64).tolist() == list(range(rank, rank + 7))
            assert by_path["empty"].nbytes == 0


def test_corrupt_shard_fails_the_flush_on_every_rank_and_the_next_one_lands(ftkit_env):
    """Rank 1's node-local shard of step 2 is damaged: the flush refuses it, every rank
    agrees on the failure, the step's directory and temp file are removed; step 4 lands."""
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(async_=False, levels="local:1,pfs:2",
                                              pfs_files="shared",
                                              faults="corrupt:rank=1:step=2:level=local"))
        errors = [error_summary(catch(ckpt.save, s, small_state(RANK, s))) for s in (1, 2, 3, 4)]
        errors.append(error_summary(catch(ckpt.close)))
        seen = (sorted(ckpt.pfs_failures), ckpt.last_flushed)
        reasons = dict(ckpt.pfs_failures)
    assert allgather(errors) == [[None] * 5] * WORLD.size
    assert allgather(seen) == [([2], 4)] * WORLD.size
    assert "rank 1" in reasons[2] and "node-local shard is corrupt" in reasons[2], reasons
    job = ftkit_env.pfs_dir / ftkit_env.job
    WORLD.Barrier()
    assert sorted(p.name for p in job.glob("step-*")) == ["step-4"]
    assert _listing(job / "step-4") == ["COMMITTED", "ftkit.h5", "ranks.h5"]


def test_a_flipped_byte_of_one_ranks_data_is_caught_for_that_rank_only(ftkit_env) -> None:
    """A ``corrupt`` fault at level pfs flips a byte of rank 2's own data in the shared
    file: reading rank 2 fails its checksum, every other rank reads its group intact."""
    with topology() as topo:
        ckpt = Checkpointer(topo, Config.load(levels="local:1,pfs:1", pfs_files="shared",
                                              faults="corrupt:rank=2:step=1:level=pfs"))
        ckpt.save(1, small_state(RANK, 1))
        ckpt.close()
    step_dir = ftkit_env.pfs_dir / ftkit_env.job / "step-1"
    WORLD.Barrier()
    hdf5.read_commit(step_dir, 1)                     # committed: the metadata is intact
    with StepReader(step_dir, 1, require_commit=True) as reader:
        for rank in range(WORLD.size):
            if rank == 2:
                with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
                    reader.read(rank)
            else:
                assert reader.read(rank)[0].attrs["rank"] == rank


@pytest.mark.parametrize("leave", [0, 1 << 20], ids=["full", "fills-mid-write"])
def test_a_full_pfs_fails_the_flush_everywhere_and_never_hangs(ftkit_env, leave) -> None:
    """The PFS (a real 8 MiB tmpfs, filled up but for ``leave`` bytes) has no room for the
    shared file — from its first metadata write on, or midway through the ranks' data: every
    rank agrees on the failure, nothing of the step stays; freed, the next flush lands."""
    if not all(allgather(os.geteuid() == 0 and shutil.which("mount") is not None)):
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    state = {"big": torch.full((300_000,), float(RANK)), "n": torch.arange(5)}
    mounted = contextlib.ExitStack()
    if RANK == 0:
        mounted.enter_context(tmpfs(ftkit_env.pfs_dir / ftkit_env.job, "8m"))
        ballast = fill(ftkit_env.pfs_dir / ftkit_env.job, leave=leave)
    WORLD.Barrier()
    with mounted:
        with topology() as topo:
            ckpt = Checkpointer(topo, Config.load(async_=False, levels="local:1,pfs:1",
                                                  pfs_files="shared"))
            first = error_summary(catch(ckpt.save, 1, state))
            failed = (sorted(ckpt.pfs_failures), ckpt.last_flushed)
            reason = ckpt.pfs_failures.get(1, "")
            WORLD.Barrier()
            if RANK == 0:
                ballast.unlink()
            WORLD.Barrier()
            second = error_summary(catch(ckpt.save, 2, state))
            ckpt.close()
        assert allgather((first, second, failed)) == [(None, None, ([1], None))] * WORLD.size
        assert "No space left on device" in reason, reason
        job = ftkit_env.pfs_dir / ftkit_env.job
        assert sorted(p.name for p in job.glob("step-*")) == ["step-2"]
        assert _listing(job / "step-2") == ["COMMITTED", "ftkit.h5", "ranks.h5"]
        WORLD.Barrier()
