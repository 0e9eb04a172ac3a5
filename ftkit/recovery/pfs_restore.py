"""Restore from the parallel-file-system level (HDF5): pick the newest committed PFS step that
every rank can read intact and load it; a different DP size is resharded (see
:func:`source_rank`). All functions that talk to other ranks say so.
"""
from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, MutableMapping
from typing import Any

from ftkit.capture.apply import load_into
from ftkit.capture.flatten import TensorLeaf, leaf_from_bytes, unflatten
from ftkit.comm.dist import DistComm
from ftkit.errors import CheckpointError, CorruptCheckpointError
from ftkit.storage import hdf5
from ftkit.storage.pfs import PfsLevel

log = logging.getLogger(__name__)


def source_rank(step_dir: Any, topo: Any) -> int:
    """The rank of the saved job whose shard this rank loads. Same world: itself. Another
    DP size with the same tp x pp: the DP replica ``dp_idx % saved dp`` of the same
    (tp, pp) shard (replicated parameters and optimizer state are identical across DP)."""
    meta = hdf5.read_index_attrs(step_dir)
    world, tp, pp = int(meta["world"]), int(meta["tp"]), int(meta["pp"])
    if world == topo.world:
        return int(topo.rank)
    if (tp, pp) != (topo.tp, topo.pp):
        raise CheckpointError(int(meta["step"]), {}, message=(
            f"{step_dir} was saved with tp={tp} pp={pp} on {world} ranks; this job has "
            f"tp={topo.tp} pp={topo.pp}: changing TP/PP needs shard attributes "
            f"(shard_dim) that these tensors do not carry"))
    dp = world // (tp * pp)
    c = topo.coords
    return c.pp * dp * tp + (c.dp % dp) * tp + c.tp


def restore_from_pfs(dc: DistComm, pfs: PfsLevel, state: MutableMapping[str, Any],
                     emit: Callable[..., None], newer_than: int = 0) -> int:
    """Load the newest committed PFS step newer than ``newer_than`` that every rank can read
    intact; a different DP size is resharded (see :func:`source_rank`). 0 when there is
    none. All ranks call."""
    candidates = dc.bcast([s for s in pfs.committed_steps() if s > newer_than]
                          if dc.rank == 0 else None, "restore-discover")
    for step in candidates:
        failure = None
        loaded: Any = None
        try:
            src = source_rank(pfs.step_dir(step), pfs.topo)
            attrs, entries, arrays = hdf5.read_rank(pfs.step_dir(step), src)
            leaves = [TensorLeaf(e["path"], e["kind"], e["dtype"], tuple(e["shape"]),
                                 e["nbytes"]) for e in entries]
            loaded = unflatten(json.loads(attrs["tree"]),
                               [leaf_from_bytes(lf, a) for lf, a in zip(leaves, arrays)])
        except (CheckpointError, CorruptCheckpointError) as exc:
            failure = str(exc)
        failures = dc.agree(failure, "restore-discover", step)
        if failures:
            if dc.rank == 0:
                log.warning("restore: PFS step %d is unusable: %s", step, failures)
            emit("restore-skip", step=step, level="pfs", failures=failures)
            continue
        dc.run(functools.partial(load_into, state, loaded, step), "restore-load", step)
        if dc.rank == 0:
            log.warning("restore: node-local levels hold no usable step newer than %d; "
                        "restored step %d from the PFS level (%s)", newer_than, step,
                        pfs.step_dir(step))
        return step
    return 0
