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
import functools
import logging
import threading
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any, TypeVar

from ftkit.capture import attached, loaders
from ftkit.capture.flatten import DecodeError, TensorLeaf, flatten
from ftkit.capture.inplace import live_leaves, plan_reading
from ftkit.capture.landing import Gate, GatedLanding
from ftkit.capture.rng import rank_local_indices
from ftkit.capture.shards import cut_difference
from ftkit.comm.dist import DistComm
from ftkit.errors import CheckpointError, CorruptCheckpointError, one_line
from ftkit.progress import NoProgress
from ftkit.recovery import reshard
from ftkit.recovery.reshard import Resharded
from ftkit.recovery.restore import check_fits, load_agreed
from ftkit.storage.pfs import h5read
from ftkit.storage.pfs.h5group import RankGroup
from ftkit.storage.pfs.h5read import StepReader
from ftkit.storage.pfs.level import PfsLevel, io_allowance

log = logging.getLogger(__name__)
T = TypeVar("T")


def source_rank(step_dir: Any, topo: Any, meta: dict[str, Any] | None = None) -> int:
    """The rank of the saved job whose shard this rank loads. Same world: itself. Another
    DP size with the same tp x pp: the DP replica ``dp_idx % saved dp`` of the same
    (tp, pp) shard, after checking that the saved DP replicas of that (tp, pp) coordinate
    hold identical tensors (:func:`check_dp_replicas`; only this rank's view, local).
    ``meta``: the verified index attributes (read when None)."""
    if meta is None:
        meta = h5read.read_index_attrs(Path(step_dir))
    world, tp, pp = int(meta["world"]), int(meta["tp"]), int(meta["pp"])
    if (tp, pp) != (topo.tp, topo.pp):
        raise CheckpointError(int(meta["step"]), {}, message=(
            f"{step_dir} was saved with tp={tp} pp={pp} on {world} ranks; this job has "
            f"tp={topo.tp} pp={topo.pp}: changing TP/PP needs declared shards "
            f"(ftkit.declare_shard, DTensor), and these tensors declare none"))
    if world == topo.world:
        return int(topo.rank)
    dp = world // (tp * pp)
    c = topo.coords
    replicas = [c.pp * dp * tp + d * tp + c.tp for d in range(dp)]
    check_dp_replicas(Path(step_dir), int(meta["step"]), replicas)
    return replicas[c.dp % dp]


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


class _Opened:
    """A PFS step opened for restore by one rank: the verified index and group of the
    saved rank it loads, and where each tensor will land (nothing read into the state)."""

    def __init__(self, reader: StepReader, src: int, state: Any, step: int,
                 group: RankGroup | None = None) -> None:
        self.reader = reader
        self.group = group or self.reader.group(src)
        leaves = [TensorLeaf(e["path"], e["kind"], e["dtype"], tuple(e["shape"]),
                             e["nbytes"]) for e in self.group.entries]
        try:
            self.reading = plan_reading(leaves, self.group.tree, state)
        except DecodeError as exc:
            raise CorruptCheckpointError(self.group.where, str(exc), rank=src, step=step,
                                         level="pfs") from None

    def read(self, gate: Gate, progress: Callable[[int], None]) -> None:
        """Every tensor into its destination (live ones through ``gate``), each checked
        against its checksum; raises on any problem."""
        landing = GatedLanding(gate)

        def into(i: int) -> GatedLanding:
            landing.start(self.reading.dests[i], self.reading.live[i])
            return landing
        try:
            self.reader.read_into(self.group, into, progress=progress)
        finally:
            landing.finish()


def _open(pfs: PfsLevel, step: int, state: Any, _progress: Callable[[int], None]
          ) -> _Opened | Resharded:
    """Open PFS ``step`` for this rank: its own group when the layout is the same; on
    another layout, every saved group when the step declares its shards
    (:mod:`ftkit.recovery.reshard`), else a DP replica (:func:`source_rank`). Local."""
    topo = pfs.topo
    step_dir = pfs.step_dir(step)
    reader = StepReader(step_dir, step, job=pfs.config.job, require_commit=True,
                        prefetch=topo.rank)
    try:
        meta = reader.meta
        own = None
        if (int(meta["world"]), int(meta["tp"]), int(meta["pp"])) == (topo.world, topo.tp,
                                                                       topo.pp):
            own = reader.group(topo.rank)
            if not _other_cut(own, state, step):
                return _Opened(reader, topo.rank, state, step, own)
        _check_loaders(meta, topo, state, step)
        groups = {r: own if r == topo.rank and own is not None else reader.group(r)
                  for r in range(int(meta["world"]))}
        if reshard.declared(groups):
            return Resharded(reader, groups, topo, state, step)
        return _Opened(reader, source_rank(step_dir, topo, meta), state, step)
    except BaseException:
        reader.close()
        raise


def _check_loaders(meta: dict[str, Any], topo: Any, state: Any, step: int) -> None:
    """Refuse a DP change with a loader whose position is one rank's share of the data (its
    samples would be skipped or seen twice, silently). CheckpointError naming it. Local."""
    world, dp = int(meta["world"]), reshard.saved_layout(meta)[0]
    path = loaders.split_by_dp(state) if dp != topo.dp else None
    if path is not None:
        raise CheckpointError(step, {}, message=(
            f"cannot restore step {step} saved at dp{dp} on dp{topo.dp}: state[{path!r}] is a "
            f"data loader whose sampler splits the data among the data-parallel ranks, and "
            f"its saved position counts one rank's share of dp{dp}; ftkit does not convert "
            f"it: restore with {world} ranks, or keep the loader out of the state and start "
            f"it at the global sample the job had reached"))


def _layout_change(meta: dict[str, Any], topo: Any, sharded: bool) -> dict[str, Any]:
    """Fields of the ``reshard`` event when the step was saved on another layout (else
    empty): ``saved`` and ``now`` as world/dp/tp/pp, and ``how`` in words."""
    world, tp, pp = int(meta["world"]), int(meta["tp"]), int(meta["pp"])
    if (world, tp, pp) == (topo.world, topo.tp, topo.pp):
        return {}
    saved = {"world": world, "dp": world // (tp * pp), "tp": tp, "pp": pp}
    now = {"world": topo.world, "dp": topo.dp, "tp": topo.tp, "pp": topo.pp}
    by = "from the saved shards" if sharded else "from a DP replica"
    how = f"resharded {by}: {_text(saved)} -> {_text(now)}"
    return {"saved": saved, "now": now, "how": how}


def _text(layout: dict[str, int]) -> str:
    return (f"{layout['world']} ranks (dp{layout['dp']} tp{layout['tp']} "
            f"pp{layout['pp']})")


def _other_cut(group: Any, state: Any, step: int) -> bool:
    """Whether this rank's saved group holds other pieces of its global tensors than the
    live state (changed DTensor placements or declarations on the same layout): then the
    step is resharded like one of another layout. Local (every rank reshards its own
    pieces; the others may still read theirs directly)."""
    saved = {e["path"]: reshard.spec_of(e) if e["shard"] is not None else None
             for e in group.entries}
    why = cut_difference(saved, state, live_leaves(state, attached.extra_layout))
    if why is not None:
        log.info("restore: PFS step %d: %s: resharded", step, why)
    return why is not None


STALLED = "made no progress"


class PfsReadTimeout(TimeoutError):
    """A PFS read made no progress within its deadline (the reading thread may still be
    stuck in the file system or the HDF5 library)."""


def transient(reason: str) -> bool:
    """Whether a PFS step was found unusable only because reading it stalled (a relaunch
    may read it fine: the error does not recur)."""
    return STALLED in reason or "still stuck" in reason


def with_deadline(work: Callable[[Callable[[int], None]], T], what: str, timeout: float,
                  gate: Gate | None = None) -> T:
    """``work(progress)`` on a daemon thread under a no-progress deadline: ``timeout``
    seconds, plus the time the bytes last announced by ``progress(n)`` need at
    ``MIN_BULK_BANDWIDTH``, since the last call. When it expires, ``gate`` is closed (the
    thread, if it ever wakes up, lands nothing more in the live state) and PfsReadTimeout
    is raised: all ranks stuck in the same hung file would otherwise wait forever (no
    collective is pending to time out). Local."""
    box: cf.Future[T] = cf.Future()
    clock = NoProgress(timeout)

    def run() -> None:
        try:
            box.set_result(work(clock.progress))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box.set_exception(exc)
    threading.Thread(target=run, name="ftkit-pfs-read", daemon=True).start()
    while True:
        remaining = clock.remaining()
        if remaining <= 0:
            if gate is not None:
                gate.close()
            raise PfsReadTimeout(f"{what} {STALLED} for {clock.allowed:g} s (FTKIT_TIMEOUT); the "
                                 f"file system or its HDF5 files may be hung")
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


class _Tries:
    """The agreed phases of :func:`restore_from_pfs`: each runs under a deadline
    (:func:`with_deadline`) on every rank, its failures are agreed, and a step that failed
    anywhere is skipped with why (logged, ``restore-skip``). Once a read was given up
    (``stuck``), no later step is read: the library or file system it hung in may still
    be stuck."""

    def __init__(self, dc: DistComm, pfs: PfsLevel, emit: Callable[..., None],
                 allow: int | None) -> None:
        self.dc, self.pfs, self.emit, self.allow = dc, pfs, emit, allow
        self.skipped: dict[int, str] = {}
        self.stuck: str | None = None
        self.abandoned = False             # the last phase's thread was given up

    def run(self, step: int, work: Callable[[Callable[[int], None]], T],
            gate: Gate | None = None) -> tuple[bool, T | None]:
        """(True, result) when ``work`` succeeded on every rank; else (False, this rank's
        result or None) and the step is skipped. All ranks call."""
        failure, result, self.abandoned = None, None, False
        try:
            if self.stuck is not None:
                raise PfsReadTimeout(f"not read: an earlier PFS read is still stuck "
                                     f"({self.stuck})")
            result = with_deadline(work, f"reading {self.pfs.step_dir(step)}",
                                   self.pfs.config.timeout, gate)
        except Exception as exc:  # noqa: BLE001 - any failure: the step is unusable
            failure = one_line(exc)
            if isinstance(exc, PfsReadTimeout) and self.stuck is None:
                self.stuck, self.abandoned = f"step {step}", True
            log.warning("rank %d: PFS step %d (%s) is unusable: %s", self.dc.rank, step,
                        self.pfs.step_dir(step), failure)
        failures = self.dc.agree(failure, "restore-discover", step, allow_bytes=self.allow)
        if not failures:
            return True, result
        reason = "; ".join(f"rank {r}: {f}" for r, f in sorted(failures.items()))
        if self.dc.rank == 0:
            log.warning("restore: PFS step %d is unusable, trying an older one: %s",
                        step, reason)
        reason = reason if len(reason) <= 1000 else reason[:997] + "..."
        self.emit("restore-skip", step=step, level="pfs", failures=failures, reason=reason)
        self.skipped[step] = reason
        return False, result


def restore_from_pfs(dc: DistComm, pfs: PfsLevel, state: MutableMapping[str, Any],
                     emit: Callable[..., None], newer_than: int = 0,
                     skip: set[int] | frozenset[int] = frozenset()
                     ) -> tuple[int, dict[int, str]]:
    """Load the newest committed PFS step newer than ``newer_than`` that every rank can read
    intact; a different DP size is resharded (see :func:`source_rank`). Each candidate is
    opened (metadata verified, destinations planned), the live state agreed to fit (else
    the same StateMismatchError everywhere, nothing written), then every tensor is read
    straight into its live counterpart where it has one (:mod:`ftkit.capture.landing`).
    Any exception while opening or reading a step on any rank makes it unusable everywhere
    (agreed), and the next older one is read over it: the state is never returned half
    one step, half another (when none is usable the caller raises). Returns the step
    loaded (0 when none) and the newer committed steps found unusable, with why (identical
    on every rank); steps in ``skip`` (found unusable before) are not read again. All
    ranks call."""
    candidates = dc.bcast([s for s in pfs.committed_steps() if s > newer_than and s not in skip]
                          if dc.rank == 0 else None, "restore-discover")
    tries = _Tries(dc, pfs, emit, io_allowance(dc, pfs.topo, _state_bytes(state),
                                               "restore-discover", None)
                   if candidates else None)
    for step in candidates:
        ok, opened = tries.run(step, functools.partial(_open, pfs, step, state))
        if opened is None:
            continue
        if not ok:                       # opened here, failed elsewhere
            opened.reader.close()
            continue
        try:
            check_fits(dc, state, opened.reading.tree, step)     # nothing written unless all fit
            gate = Gate()
            ok, _ = tries.run(step, functools.partial(opened.read, gate), gate)
        finally:
            if not tries.abandoned:
                opened.reader.close()
        if not ok:
            continue
        load_agreed(dc, state, opened.reading.tree, step)
        moved = _layout_change(opened.reader.meta, pfs.topo, isinstance(opened, Resharded))
        if moved:
            emit("reshard", step=step, **moved)
        if dc.rank == 0:
            log.warning("restore: node-local levels hold no usable step newer than %d; "
                        "restored step %d from the PFS level (%s)%s", newer_than, step,
                        pfs.step_dir(step), f", {moved['how']}" if moved else "")
        return step, tries.skipped
    return 0, tries.skipped
