"""Early PFS writes: a rank's PFS file of a step written while the capture fills its slot
(docs/protocol.md, "The early write").

A step due at both ``local`` and ``pfs`` is captured into a reserved slot of the node-local
level (:mod:`ftkit.storage.slots`). When this rank has no flush running, an *early write*
starts on a thread of its own as the capture begins (an asynchronous Checkpointer: once the
staging has landed, so it never slows down what the training loop may wait for): it writes
this rank's PFS file tensor by tensor as each one lands in the slot
(:meth:`Reservation.wait_landed`, which gives the tensor's checksum), verifying the bytes it
copies against that checksum, under a private temp name in the job's staging directory
``<pfs>/<job>/.early/``. So the PFS write of a step
overlaps its capture and its protocol instead of following them.

The early file is the *tentative* snapshot's and nothing names it. It becomes part of the
PFS step only in the flush of that step — after the step's local commit, after rank 0 made
the step directory and retracted any older ``COMMITTED`` record of the same step number,
and after every rank agreed on that — when the rank renames it to
``step-<s>/rank-<r>.h5`` (:meth:`EarlyWrite.adopt`). Every other outcome (the vote aborts
the step, the capture fails, the flush is delayed or skipped, the Checkpointer closes or is
abandoned) discards it (:meth:`EarlyWrite.discard`): its thread stops at the next tensor
and the temp is removed. A crash leaves a temp that nothing names and nothing reads: rank
0 removes every one as its next Checkpointer starts (the relaunch; an in-job generation).
The PFS step's ``COMMITTED`` record stays its only commit point. Local.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Any

import numpy as np

from ftkit.faults import Faults
from ftkit.fs import rename_into_place
from ftkit.storage.pfs import hdf5
from ftkit.storage.shard import layout
from ftkit.storage.slots import PLACEHOLDER, Reservation

#: the staging directory of early writes, under the job's PFS directory (no step directory)
STAGING = ".early"
#: the fault phase of an early write: it fires when the write reaches its second tensor
#: (the first one's bytes are in the temp file), on the early write's thread
PHASE = "flush-early"
_TEMP = re.compile(r"\.rank-\d+\.h5\..+\.tmp")


class LandingShard:
    """The tentative shard in a reserved slot as :func:`hdf5.write_rank_group` reads it:
    the header the shard will have, each tensor's bytes and checksum once it landed
    (``raw(i)`` blocks until then; :class:`~ftkit.storage.slots.NotLanding` when the
    snapshot is given up)."""

    def __init__(self, res: Reservation, faults: Faults, step: int) -> None:
        head, _ = layout(res.meta, res.tree, res.leaves, [PLACEHOLDER] * len(res.leaves))
        self.header: dict[str, Any] = json.loads(head)
        self.path = res.slot
        self._res, self._faults, self._step = res, faults, step

    @property
    def tensors(self) -> list[dict[str, Any]]:
        return self.header["tensors"]   # type: ignore[no-any-return]

    def raw(self, index: int) -> np.ndarray:
        """Read-only view of tensor ``index`` in the slot, once it landed; its entry in
        :attr:`tensors` then holds its checksum."""
        if index == min(1, len(self.tensors) - 1):
            self._faults.fire(PHASE, self._step)
        self.tensors[index]["checksum"] = self._res.wait_landed(index)
        view = self._res.view(index).view()
        view.flags.writeable = False
        return view


class EarlyWrite:
    """This rank's PFS file of ``step``, written on ``pool``'s thread from the reservation
    ``res`` as its tensors land; to :meth:`adopt` (the step's flush) or :meth:`discard`
    (anything else), once."""

    def __init__(self, step: int, res: Reservation, staging: Path, rank: int,
                 topology: dict[str, Any], pool: cf.ThreadPoolExecutor, faults: Faults,
                 patience: float) -> None:
        self.step, self._res, self._patience = step, res, patience
        self._adopted = False
        self.started = time.monotonic()       # when the PFS write of the step began
        self._future = pool.submit(self._write, staging / f"rank-{rank}.h5", topology,
                                   faults)

    def _write(self, path: Path, topology: dict[str, Any], faults: Faults
               ) -> tuple[Path, dict[str, Any]]:
        return hdf5.write_rank_temp(path, LandingShard(self._res, faults, self.step), topology)

    def adopt(self, target: Path) -> dict[str, Any]:
        """Wait for the write (up to the patience) and rename it to ``target`` (fsync of its
        directory): the flush of the step, once the step is committed and its directory is
        prepared. Returns the file digest; raises what the write raised (a corrupt slot, a
        full or failing PFS: the flush fails as if it had written the file itself)."""
        try:
            tmp, digest = self._future.result(timeout=self._patience)
        except cf.TimeoutError:
            self.discard()
            raise TimeoutError(f"the early PFS write of step {self.step} did not finish "
                               f"within {self._patience:g} s") from None
        rename_into_place(tmp, target)
        self._adopted = True
        return digest

    def discard(self, wait: float = 0.0) -> None:
        """Give the write up, unless it was adopted: it stops at its next tensor, its temp is
        removed once it ends (a write that already ended: now). ``wait``: seconds to wait for
        that."""
        if self._adopted:
            return
        self._res.drop()
        self._future.add_done_callback(_remove_temp)
        if wait:
            cf.wait([self._future], timeout=wait)


def _remove_temp(future: cf.Future[tuple[Path, dict[str, Any]]]) -> None:
    if future.cancelled() or future.exception() is not None:
        return                       # a failed write removed its temp itself
    future.result()[0].unlink(missing_ok=True)


def staging_dir(job_pfs_dir: Path) -> Path:
    """The job's early-write directory, created when missing (OSError when it cannot be,
    or when something else than a directory has the name)."""
    path = job_pfs_dir / STAGING
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        pass
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise OSError(f"{path}: not a directory")
    return path


def remove_stale(staging: Path) -> None:
    """Remove every early write's temp in ``staging`` (rank 0, as a Checkpointer starts:
    no early write of it runs yet, so they are what a crashed attempt left). Local."""
    try:
        entries = list(os.scandir(staging))
    except OSError:
        return
    for entry in entries:
        if _TEMP.fullmatch(entry.name):
            with contextlib.suppress(OSError):         # removed meanwhile
                os.unlink(entry.path)
