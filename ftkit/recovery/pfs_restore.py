"""Restore from the parallel-file-system level (HDF5): pick the newest committed PFS step that
every rank can read intact and load it; a different DP size is resharded (see
:func:`source_rank`). All functions that talk to other ranks say so.

Nothing read from the PFS is trusted before it is verified (see :mod:`ftkit.storage.pfs.hdf5`),
and *any* failure while reading or decoding a candidate step — a damaged HDF5 structure, an
attribute that does not decode, a tree that does not rebuild — makes that step unusable with a
one-line reason (logged, ``restore-skip`` event); restore then tries the next older step.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

from ftkit.capture.flatten import TensorLeaf, flatten, leaf_from_bytes, unflatten
from ftkit.comm.dist import MIN_BULK_BANDWIDTH, DistComm
from ftkit.errors import CheckpointError
from ftkit.recovery.plan import one_line
from ftkit.recovery.restore import apply_agreed
from ftkit.storage.pfs import h5read
from ftkit.storage.pfs.h5read import StepReader
from ftkit.storage.pfs.level import PfsLevel, io_allowance

log = logging.getLogger(__name__)
_RNG_KEYS = {"python", "numpy", "torch", "cuda"}    # the state_dict of ftkit.RNGState


def source_rank(step_dir: Any, topo: Any, meta: dict[str, Any] | None = None) -> int:
    """The rank of the saved job whose shard this rank loads. Same world: itself. Another
    DP size with the same tp x pp: the DP replica ``dp_idx % saved dp`` of the same
    (tp, pp) shard, after checking that the saved DP replicas of that (tp, pp) coordinate
    hold identical tensors (:func:`check_dp_replicas`; only this rank's view, local).
    ``meta``: the verified index attributes (read when None)."""
    if meta is None:
        meta = h5read.read_index_attrs(Path(step_dir))
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
    replicas = [c.pp * dp * tp + d * tp + c.tp for d in range(dp)]
    check_dp_replicas(Path(step_dir), int(meta["step"]), replicas)
    return replicas[c.dp % dp]


def rank_local_indices(tree: Any) -> set[int]:
    """Tensor indices of the state that legitimately differ between DP replicas: those of
    ``ftkit.RNGState`` objects (each rank draws its own random streams)."""
    found: set[int] = set()

    def tensors(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("t") == "tensor":
                found.add(int(node["i"]))
            for v in node.values():
                tensors(v)
        elif isinstance(node, list):
            for v in node:
                tensors(v)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            inner = node.get("v")
            if node.get("t") == "obj" and isinstance(inner, dict) and inner.get("t") == "dict":
                keys = {k for k, _ in inner.get("items", [])}
                if {"python", "numpy"} <= keys <= _RNG_KEYS:
                    tensors(inner)
                    return
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(tree)
    return found


def check_dp_replicas(step_dir: Path, step: int, replicas: list[int]) -> None:
    """Resharding by DP assumes the DP replicas of one (tp, pp) coordinate hold identical
    state: compare the per-tensor checksums (verified metadata, no data read) of the saved
    ``replicas``; RNG state is rank-local and exempt. CheckpointError when they differ
    (e.g. ZeRO-sharded optimizer state). Local."""
    with StepReader(step_dir, step) as reader:
        first: dict[str, str] | None = None
        for rank in replicas:
            group = reader.group(rank)
            skip = rank_local_indices(group.tree)
            sums = {e["path"]: e["checksum"] for e in group.entries if e["index"] not in skip}
            if first is None:
                first = sums
                continue
            for path in sorted(set(first) | set(sums)):
                if first.get(path) != sums.get(path):
                    raise CheckpointError(step, {}, message=(
                        f"{step_dir} (level pfs, step {step}): DP replicas differ at tensor "
                        f"{path!r} (rank {replicas[0]} vs {rank}): sharded optimizer state "
                        f"cannot be resharded by DP; restore with the saved world size "
                        f"({reader.meta.get('world')} ranks)"))


def _read_step(pfs: PfsLevel, step: int, progress: Callable[[int], None] | None = None
               ) -> Any:
    """This rank's state tree of PFS ``step``, every byte verified (raises on any problem):
    the step's COMMITTED record and file digests are required, so libhdf5 never parses a
    damaged byte. Local."""
    step_dir = pfs.step_dir(step)
    with StepReader(step_dir, step, job=pfs.config.job, require_commit=True) as reader:
        src = source_rank(step_dir, pfs.topo, reader.meta)
        group, arrays = reader.read(src, progress=progress)
    leaves = [TensorLeaf(e["path"], e["kind"], e["dtype"], tuple(e["shape"]), e["nbytes"])
              for e in group.entries]
    return unflatten(group.tree, [leaf_from_bytes(lf, a) for lf, a in zip(leaves, arrays)])


STALLED = "made no progress"


class PfsReadTimeout(TimeoutError):
    """A PFS read made no progress within its deadline (the reading thread may still be
    stuck in the file system or the HDF5 library)."""


def transient(reason: str) -> bool:
    """Whether a PFS step was found unusable only because reading it stalled (a relaunch
    may read it fine: the error does not recur)."""
    return STALLED in reason or "still stuck" in reason


def read_with_deadline(pfs: PfsLevel, step: int, timeout: float) -> Any:
    """:func:`_read_step` on a daemon thread under a no-progress deadline: ``timeout``
    seconds, plus the time the tensor being read needs at ``MIN_BULK_BANDWIDTH``, since the
    last tensor finished. Raises PfsReadTimeout when it expires (all ranks reading the same
    hung file would otherwise wait forever: no collective is pending to time out). Local."""
    box: cf.Future[Any] = cf.Future()
    mark = [time.monotonic(), 0]          # last progress, bytes announced since

    def progress(nbytes: int) -> None:
        mark[:] = [time.monotonic(), nbytes]

    def work() -> None:
        try:
            box.set_result(_read_step(pfs, step, progress))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box.set_exception(exc)
    threading.Thread(target=work, name=f"ftkit-pfs-read-{step}", daemon=True).start()
    while True:
        allowed = timeout + mark[1] / MIN_BULK_BANDWIDTH
        remaining = mark[0] + allowed - time.monotonic()
        if remaining <= 0:
            raise PfsReadTimeout(f"reading {pfs.step_dir(step)} {STALLED} for "
                                 f"{allowed:g} s (FTKIT_TIMEOUT); the file system or its "
                                 f"HDF5 files may be hung")
        try:
            return box.result(timeout=remaining)
        except cf.TimeoutError:
            continue


def _state_bytes(state: Any) -> int:
    """The tensor bytes of ``state`` (what a rank reads back from the PFS); 0 when it cannot
    be flattened (the restore itself then says why). Local."""
    try:
        return sum(leaf.nbytes for leaf in flatten(state)[1])
    except Exception:  # noqa: BLE001 - only a deadline estimate
        return 0


def restore_from_pfs(dc: DistComm, pfs: PfsLevel, state: MutableMapping[str, Any],
                     emit: Callable[..., None], newer_than: int = 0,
                     skip: set[int] | frozenset[int] = frozenset()
                     ) -> tuple[int, dict[int, str]]:
    """Load the newest committed PFS step newer than ``newer_than`` that every rank can read
    intact; a different DP size is resharded (see :func:`source_rank`). Any exception while
    reading or decoding a step on any rank makes it unusable everywhere (agreed), and the
    next older one is tried. Returns the step loaded (0 when none) and the newer committed
    steps found unusable, with why (identical on every rank); steps in ``skip`` (found
    unusable before) are not read again. All ranks call."""
    candidates = dc.bcast([s for s in pfs.committed_steps() if s > newer_than and s not in skip]
                          if dc.rank == 0 else None, "restore-discover")
    skipped: dict[int, str] = {}
    stuck: str | None = None
    allow = io_allowance(dc, pfs.topo, _state_bytes(state), "restore-discover", None) \
        if candidates else None
    for step in candidates:
        failure = None
        loaded: Any = None
        try:
            if stuck is not None:
                raise PfsReadTimeout(f"not read: an earlier PFS read is still stuck ({stuck})")
            loaded = read_with_deadline(pfs, step, pfs.config.timeout)
        except Exception as exc:  # noqa: BLE001 - any failure: the step is unusable
            failure = one_line(exc)
            if isinstance(exc, PfsReadTimeout) and stuck is None:
                stuck = f"step {step}"
            log.warning("rank %d: PFS step %d (%s) is unusable: %s", dc.rank, step,
                        pfs.step_dir(step), failure)
        failures = dc.agree(failure, "restore-discover", step, allow_bytes=allow)
        if failures:
            reason = "; ".join(f"rank {r}: {f}" for r, f in sorted(failures.items()))
            if dc.rank == 0:
                log.warning("restore: PFS step %d is unusable, trying an older one: %s",
                            step, reason)
            reason = reason if len(reason) <= 1000 else reason[:997] + "..."
            emit("restore-skip", step=step, level="pfs", failures=failures, reason=reason)
            skipped[step] = reason
            continue
        apply_agreed(dc, state, loaded, step)
        if dc.rank == 0:
            log.warning("restore: node-local levels hold no usable step newer than %d; "
                        "restored step %d from the PFS level (%s)", newer_than, step,
                        pfs.step_dir(step))
        return step, skipped
    return 0, skipped
