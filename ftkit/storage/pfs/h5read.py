"""Reading a PFS step (HDF5, :mod:`ftkit.storage.pfs.hdf5`) as untrusted input.

:class:`StepReader` trusts nothing it has not checked, in this order:

1. the step's ``COMMITTED`` record (its own checksum; required for restore, used whenever
   present), which holds a byte digest of every HDF5 file of the step;
2. each file, against its digest, *before* h5py opens it (:func:`h5files.check_file`): libhdf5
   never parses a damaged byte of a committed step;
3. each file's root (``format``, ``meta_checksum``) and the index's ``world``/``step``/``job``;
4. ``/rank/<r>``: external links are resolved by ftkit, not by HDF5 — the index's only to a
   ``node-<id>.h5``, ``rank-<r>.h5`` or the shared ``ranks.h5`` inside the step directory, a
   node file's only to ``rank-<r>.h5``, each opened by that validated name (HDF5 would also
   search the working directory and ``HDF5_EXT_PREFIX``), and only its ``/rank/<r>``;
5. the rank group (:meth:`h5group.RankGroup.load`): seal, identity, hard links only, storage
   inside the file, attributes against stored dtype/shape, tree against datasets;
6. every tensor's bytes against its checksum as they are read.

Once a rank file passed 2., its tensor ranges are read into the page cache on a thread
(:mod:`ftkit.storage.pfs.prefetch`) while 3.-5. run, until the first tensor read.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import numpy as np
import xxhash

from ftkit.buffers import aligned_empty
from ftkit.capture.landing import GatedLanding
from ftkit.errors import CorruptCheckpointError
from ftkit.storage.pfs import h5data, h5files
from ftkit.storage.pfs.h5group import RankGroup
from ftkit.storage.pfs.hdf5 import COMMITTED, INDEX, check_root, read_commit
from ftkit.storage.pfs.prefetch import Prefetch
from ftkit.storage.shard import Landing


def _h5py() -> Any:
    import h5py
    return h5py


class StepReader:
    """A verified, open index ``step_dir/ftkit.h5`` (or ``file``, e.g. a node file of the
    step, read on its own; context manager). ``meta``: its attributes, trusted.

    ``require_commit``: the step must have a verified COMMITTED record with file digests
    (restore); otherwise one is used when present. ``job``: the job the step must belong to.
    ``prefetch``: that rank's file (``rank-<r>.h5``), checked against its digest as soon as
    COMMITTED is read, has its tensor ranges read into the page cache from then until the
    first tensor read, while the index, node file and group are opened and verified
    (:mod:`ftkit.storage.pfs.prefetch`: a restore's own rank, whose file it reads next; not
    a tool that may read only metadata, nor every rank of a job the file of one)."""

    def __init__(self, step_dir: Path, step: int | None = None, *,
                 file: Path | None = None, job: str | None = None,
                 require_commit: bool = False, prefetch: int | None = None) -> None:
        self.step_dir, self.step, self.job = Path(step_dir), step, job
        self.path = Path(file) if file is not None else self.step_dir / INDEX
        self.alone = file is not None
        self.record: dict[str, Any] | None = None
        self.digests: dict[str, Any] | None = None
        if require_commit or os.path.lexists(self.step_dir / COMMITTED):
            self.record = read_commit(self.step_dir, step)
            files = self.record.get("files")
            if not isinstance(files, dict):
                raise CorruptCheckpointError(
                    str(self.step_dir / COMMITTED), "records no file digests (written by an "
                    "older ftkit): its HDF5 files cannot be checked before they are opened",
                    step=step, level="pfs")
            self.digests = files
        self._nodes: dict[str, tuple[Any, int]] = {}
        self._fds: dict[str, int] = {}
        self.prefetch: Prefetch | None = None
        if prefetch is not None:
            self._prefetch(prefetch)
        try:
            self.h5, self.size = self._open(self.path, None)
        except BaseException:
            self._stop_prefetch()
            raise
        try:
            self.meta = check_root(self.h5, str(self.path), step=step)
            self._check_job(self.meta.get("job"), str(self.path))
        except BaseException:
            self.h5.close()
            self._stop_prefetch()
            raise

    def _check_job(self, job: Any, where: str) -> None:
        if self.job is not None and job is not None and job != self.job:
            raise CorruptCheckpointError(where, f"belongs to job {job!r}, not {self.job!r}",
                                         step=self.step, level="pfs")

    def _open(self, path: Path, rank: int | None) -> tuple[Any, int]:
        """Check ``path`` against its digest (when the step has them), then open it. A
        file the record does not list is refused, unless it is the one file asked for."""
        digest = None if self.digests is None else self.digests.get(path.name)
        alone = self.alone and path == self.path     # a file asked for by name
        check = self.digests is not None and (digest is not None or not alone)
        return h5files.open_file(path, digest, check=check, step=self.step, rank=rank)

    def _prefetch(self, rank: int) -> None:
        """Start reading ``rank``'s file's tensor ranges ahead, once the file matched its
        digest (a file that does not is left to :meth:`group`, which says why)."""
        name = f"rank-{rank}.h5"
        digest = None if self.digests is None else self.digests.get(name)
        if digest is None:
            return
        try:
            h5files.check_file(self.step_dir / name, digest, step=self.step, rank=rank)
        except CorruptCheckpointError:
            return
        self.prefetch = Prefetch(self.step_dir / name, digest["raw"])  # checked: valid ranges

    def _stop_prefetch(self) -> None:
        """Tensor bytes are read from now on (or never): the prefetch has done its part."""
        if self.prefetch is not None:
            self.prefetch.stop()

    def close(self) -> None:
        self._stop_prefetch()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for h5, _ in self._nodes.values():
            h5.close()
        self._nodes.clear()
        self.h5.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ranks(self) -> list[int]:
        """The ranks the file links or holds (``/rank/<r>`` members with a decimal name)."""
        if not isinstance(self.h5.get("rank", getlink=True), _h5py().HardLink):
            return []
        return sorted(int(n) for n in self.h5["rank"] if n.isdecimal())

    def _node(self, name: str, rank: int) -> tuple[Any, int]:
        if name not in self._nodes:
            path = self.step_dir / name
            h5, size = self._open(path, rank)
            try:
                check_root(h5, str(path), step=self.step)
            except BaseException:
                h5.close()
                raise
            self._nodes[name] = (h5, size)
        return self._nodes[name]

    def group(self, rank: int) -> RankGroup:
        """The verified group of ``rank``, reached through at most two external links, each
        resolved by ftkit: the index (or a file read on its own) may link to a node file, to
        that rank's file or to the shared file, a node file only to that rank's file, a rank
        file or the shared file to nothing."""
        h5, size, file = self.h5, self.size, self.path
        while True:
            link = _rank_link(h5, rank)
            if not isinstance(link, _h5py().ExternalLink):
                break
            name = self._link_target(link, rank, file)
            h5, size = self._node(name, rank)
            file = self.step_dir / name
        if not isinstance(link, _h5py().HardLink):
            why = f"rank {rank} is not linked" if link is None else \
                f"is a {type(link).__name__}; expected a group or an external link"
            raise CorruptCheckpointError(f"{file}:/rank/{rank}", why, rank=rank,
                                         step=self.step, level="pfs")
        grp = _rank_group(h5, rank, file, self.step)
        world = self.meta.get("world")
        return RankGroup.load(grp, file, rank=rank, step=self.step,
                              world=world if isinstance(world, int) else None,
                              job=self.meta.get("job") or self.job, file_size=size)

    def _link_target(self, link: Any, rank: int, file: Path) -> str:
        """The validated file name an external link ``/rank/<rank>`` of ``file`` leads to."""
        if h5files.rank_file_name(file.name, rank):
            allowed, what = None, "nothing: a rank file holds its group"
        elif h5files.shared_file_name(file.name):
            allowed, what = None, "nothing: the shared file holds every rank's group"
        elif h5files.node_file_name(file.name):
            allowed = h5files.rank_file_name(link.filename, rank)
            what = f"only /rank/{rank} of rank-{rank}.h5 in the step directory is followed"
        else:
            allowed = h5files.node_file_name(link.filename) or \
                h5files.rank_file_name(link.filename, rank) or \
                h5files.shared_file_name(link.filename)
            what = (f"only /rank/{rank} of a node-<id>.h5 file in the step directory is "
                    f"followed (or of rank-{rank}.h5 or {h5files.SHARED_FILE})")
        if allowed is None or link.path != f"/rank/{rank}":
            raise CorruptCheckpointError(
                f"{file}:/rank/{rank}", f"links to {link.filename}:{link.path}; {what}",
                rank=rank, step=self.step, level="pfs")
        return allowed

    def read(self, rank: int, *, verify: bool = True,
             progress: Callable[[int], None] | None = None
             ) -> tuple[RankGroup, list[np.ndarray]]:
        """``rank``'s verified group and raw uint8 arrays (new) in tree order; see
        :meth:`read_into`. Raises CorruptCheckpointError."""
        group = self.group(rank)
        arrays = [aligned_empty(e["nbytes"]) for e in group.entries]
        landing = GatedLanding()

        def into(i: int) -> Landing:
            landing.start(arrays[i], live=False)      # new arrays: read into directly
            return landing
        self.read_into(group, into, verify=verify, progress=progress)
        return group, arrays

    def read_into(self, group: RankGroup, into: Callable[[int], Landing], *,
                  verify: bool = True, progress: Callable[[int], None] | None = None) -> None:
        """Read every tensor of ``group`` (from :meth:`group`) in tree order, piece by piece,
        into the landing ``into(i)`` returns for tensor i (:mod:`ftkit.storage.pfs.h5data`);
        with ``verify``, each checksum checked once its bytes have landed. ``progress(n)`` is
        called before each tensor with its size and with 0 once it is read (a deadline can
        allow for the bytes announced). Raises CorruptCheckpointError naming the dataset."""
        rank = int(group.attrs["rank"])
        for i, (entry, ds) in enumerate(zip(group.entries, group.datasets)):
            if progress is not None:
                progress(entry["nbytes"])
            self._tensor(rank, group, entry, ds, into(i), verify)
            if progress is not None:
                progress(0)

    def read_tensor(self, group: RankGroup, index: int, landing: Landing) -> None:
        """Tensor ``index`` of ``group`` into ``landing``, its checksum checked (see
        :meth:`read_into`)."""
        self._tensor(int(group.attrs["rank"]), group, group.entries[index],
                     group.datasets[index], landing, True)

    def read_blocks(self, group: RankGroup, index: int, blocks: list[int], out: np.ndarray
                    ) -> bool:
        """Only ``blocks`` of tensor ``index`` of ``group`` (its ``block_checksums``) into
        their places of ``out`` (flat uint8 of the tensor's size), each checked against its
        block's checksum; False (nothing read) when the tensor records no blocks or its
        bytes cannot be read straight from the file (the caller then reads it whole).
        CorruptCheckpointError naming the dataset and block on a mismatch."""
        entry, ds = group.entries[index], group.datasets[index]
        rank = int(group.attrs["rank"])
        where = h5data.spans(ds, entry["nbytes"]) if entry["blocks"] else None
        if where is None:
            return False
        size, sums = entry["blocks"]
        for b in blocks:
            lo = b * size
            piece = out[lo:min(lo + size, entry["nbytes"])]
            try:
                h5data.read_range(self._fd(Path(group.file), rank), where, lo, piece)
            except Exception as exc:
                raise self._bad(group, ds, rank, f"unreadable data: {type(exc).__name__}: "
                                                 f"{exc}") from exc
            if xxhash.xxh3_64_intdigest(piece.data) != sums[b]:
                raise self._bad(group, ds, rank, f"block {b} (bytes {lo}..{lo + len(piece)}) "
                                                 f"does not match its checksum")
        return True

    def _bad(self, group: RankGroup, ds: Any, rank: int, why: str) -> CorruptCheckpointError:
        """The error of a dataset whose data cannot be used."""
        return CorruptCheckpointError(f"{group.file}:{ds.name}", why, rank=rank,
                                      step=self.step, level="pfs")

    def _tensor(self, rank: int, group: RankGroup, entry: dict[str, Any], ds: Any,
                landing: Landing, verify: bool) -> None:
        """One dataset's bytes into ``landing``, checksum checked (with ``verify``)."""
        try:
            got = h5data.read_dataset(self._fd(Path(group.file), rank), ds, entry["nbytes"],
                                      landing)
        except Exception as exc:
            raise self._bad(group, ds, rank,
                            f"unreadable data: {type(exc).__name__}: {exc}") from exc
        if verify and got != entry["checksum"]:
            raise self._bad(group, ds, rank, f"checksum mismatch (stored {entry['checksum']}, "
                                             f"data has {got})")

    def _fd(self, path: Path, rank: int) -> int:
        """``path`` (a file of this step already checked and opened) open for ``preadv``:
        every read of tensor bytes starts here, so the prefetch stops here."""
        self._stop_prefetch()
        key = str(path)
        if key not in self._fds:
            self._fds[key] = h5files.open_regular(path, step=self.step, rank=rank)
        return self._fds[key]


def _rank_link(h5: Any, rank: int) -> Any:
    """The link ``/rank/<r>`` of an open file (None when absent or ``/rank`` is not plain)."""
    top = h5.get("rank", getlink=True)
    return h5["rank"].get(str(rank), getlink=True) \
        if isinstance(top, _h5py().HardLink) else None


def _rank_group(h5: Any, rank: int, file: Path, step: int | None) -> Any:
    """``/rank/<r>`` of an open node or rank file, reached by hard links only."""
    h5py = _h5py()
    grp = h5.get(f"rank/{rank}") if isinstance(_rank_link(h5, rank), h5py.HardLink) else None
    if not isinstance(grp, h5py.Group):
        raise CorruptCheckpointError(f"{file}:/rank/{rank}", "no such group (or not a plain "
                                     "group)", rank=rank, step=step, level="pfs")
    return grp


def read_rank(step_dir: Path, rank: int, *, step: int | None = None, verify: bool = True
              ) -> tuple[dict[str, Any], list[dict[str, Any]], list[np.ndarray]]:
    """Read ``/rank/<r>`` through the index: (group attrs, tensor entries, raw uint8 arrays)
    in leaf order; metadata and data checksums verified. Raises CorruptCheckpointError
    naming the file."""
    with StepReader(step_dir, step) as reader:
        group, arrays = reader.read(rank, verify=verify)
    return group.attrs, group.entries, arrays


def read_index_attrs(step_dir: Path, step: int | None = None) -> dict[str, Any]:
    """Verified attributes of ``step_dir/ftkit.h5`` (CorruptCheckpointError when unreadable
    or not trusted)."""
    with StepReader(step_dir, step) as reader:
        return reader.meta
