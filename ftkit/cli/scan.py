"""Locate and read the steps of an HDF5 checkpoint (for ``ftkit inspect/verify/export``).

Every read goes through :class:`ftkit.storage.pfs.h5read.StepReader` (COMMITTED digests checked
before a file is opened, links resolved by ftkit, storage checked against the file size) and
runs in a child process (:mod:`ftkit.cli.sandbox`), reporting progress to it. Imports h5py
lazily; never mpi4py or torch.
"""
from __future__ import annotations

import dataclasses
import os
import re
import stat
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import xxhash

from ftkit.cli.fmt import human
from ftkit.errors import CorruptCheckpointError
from ftkit.jobdir import paths
from ftkit.storage.pfs import h5files
from ftkit.storage.pfs.h5data import BlockSums
from ftkit.storage.pfs.hdf5 import COMMITTED, INDEX
from ftkit.storage.pfs.hdf5 import raw_bytes as _raw
from ftkit.storage.stepnames import step_dirs, step_number

OK, BAD, USAGE = 0, 1, 2
COMMIT_RECORD = COMMITTED
BLOCK_BYTES = 64 << 20          # datasets are read in blocks of at most about this size
_RANK = re.compile(r"0|[1-9][0-9]{0,8}")


class UsageError(Exception):
    """PATH, ``--step`` or an option cannot be used (exit status 2)."""


class BadInput(Exception):
    """The checkpoint (or a file PATH names) is unusable: not a regular file, corrupt,
    incomplete (exit status 1)."""


class ExportError(BadInput):
    """The chosen step cannot be exported (exit status 1)."""


class Reporter(Protocol):
    """What the reading code needs of :class:`ftkit.cli.sandbox.Reporter`."""

    def progress(self, where: str | None = None, nbytes: int = 0, datasets: int = 0) -> None:
        """Now reading ``where``; ``nbytes`` more bytes and ``datasets`` more datasets done."""


class _Silent:
    """A :class:`Reporter` for reading outside a sandbox."""

    def progress(self, where: str | None = None, nbytes: int = 0, datasets: int = 0) -> None:
        """Nothing."""


def h5py_module() -> Any:
    """h5py (UsageError when it is not installed)."""
    try:
        import h5py
    except ImportError as exc:  # pragma: no cover - h5py is a dependency
        raise UsageError(f"h5py is needed to read HDF5 checkpoints: {exc}") from exc
    return h5py


def not_regular(path: Path) -> str | None:
    """None when ``path`` is a regular file (not a symlink), else why not: "missing",
    "is a directory", ..."""
    if not os.path.lexists(path):
        return "missing"
    try:
        h5files.regular_file(path)
    except CorruptCheckpointError as exc:
        return exc.reason
    return None


# --------------------------------------------------------------------------- locating steps

@dataclasses.dataclass(frozen=True)
class StepRef:
    """One step: its number (from ``step-<s>``; None if unknown), directory and the HDF5 file
    to open (``ftkit.h5``, or the file PATH named)."""

    step: int | None
    dir: Path
    h5: Path

    def state(self) -> tuple[bool, str | None]:
        """(committed, why not): committed when ``COMMITTED`` is a regular file and the HDF5
        file exists (whether either can be trusted is checked when the step is read)."""
        why, missing = [], False
        record = not_regular(self.dir / COMMIT_RECORD)
        if record is not None:
            missing = record == "missing"
            why.append(f"no {COMMIT_RECORD} record" if missing else f"{COMMIT_RECORD} {record}")
        if not os.path.lexists(self.h5):
            missing = True
            why.append(f"{self.h5.name} missing")
        if not why:
            return True, None
        return False, " and ".join(why) + (" (a flush that crashed or is still running)"
                                           if missing else "")

    @property
    def own_index(self) -> bool:
        """Whether the file is the step's own index (its COMMITTED digests apply)."""
        return self.h5 == self.dir / INDEX

    @property
    def label(self) -> str:
        return f"step {self.step}" if self.step is not None else str(self.h5)


@dataclasses.dataclass
class Target:
    """What PATH names: a job directory's steps, or one step."""

    path: Path
    job_dir: Path | None
    steps: list[StepRef]
    single: bool

    def pick(self, step: int | None) -> StepRef:
        """The step ``--step`` names, or the only step of a one-step PATH."""
        if self.single:
            ref = self.steps[0]
            if step is not None and ref.step is not None and step != ref.step:
                raise UsageError(f"{self.path} is step {ref.step}, not step {step}")
            return ref
        for ref in self.steps:
            if ref.step == step:
                return ref
        raise UsageError(f"no step {step} in {self.path} (steps: {self.step_list()})")

    def newest(self) -> StepRef | None:
        """The newest committed step, else the newest step, else None."""
        committed = [r for r in self.steps if r.state()[0]]
        pool = committed or self.steps
        return pool[-1] if pool else None

    def step_list(self) -> str:
        return ", ".join(str(r.step) for r in self.steps) or "none"


def _step_number(directory: Path) -> int | None:
    return step_number(directory.name)


def _is_step_dir(directory: Path) -> bool:
    return (_step_number(directory) is not None or os.path.lexists(directory / INDEX)
            or os.path.lexists(directory / COMMIT_RECORD)
            or any(h5files.step_file(p.name) for p in directory.glob("*.h5")))


def _job_of(step_dir: Path) -> Path | None:
    return step_dir.parent if _step_number(step_dir) is not None else None


def resolve(text: str) -> Target:
    """Interpret PATH (UsageError; BadInput when it is neither a regular file nor a
    directory)."""
    path = Path(text)
    try:
        if not path.exists():
            raise UsageError(f"{path}: no such file or directory")
        if not path.is_dir():
            if not path.is_file():
                raise BadInput(f"{path}: {_kind(path)}, not a regular file or directory")
            d = path.parent
            return Target(path, _job_of(d), [StepRef(_step_number(d), d, path)], True)
        steps = step_dirs(path)
        if not steps and _is_step_dir(path):
            ref = StepRef(_step_number(path), path, path / INDEX)
            return Target(path, _job_of(path), [ref], True)
        if steps or os.path.lexists(path / paths.EVENTS):
            return Target(path, path, [StepRef(n, d, d / INDEX) for n, d in steps], False)
        jobs = sorted(p.name for p in path.iterdir() if p.is_dir() and step_dirs(p))
    except PermissionError as exc:
        raise UsageError(f"{path}: {exc.strerror}") from exc
    hint = f"; it holds the job directories {', '.join(jobs)}" if jobs else ""
    raise UsageError(f"{path}: neither a job directory (with step-<s> directories) nor a step "
                     f"directory{hint}")


def _kind(path: Path) -> str:
    """``is a FIFO``, ``is a socket``, ... (PATH's kind, links followed)."""
    mode = path.stat().st_mode
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return f"is {name}"
    return "is not a regular file"


# --------------------------------------------------------------------------- reading a step

@dataclasses.dataclass
class Bad:
    """One problem: where (``file:/object`` or a path) and why."""

    where: str
    why: str

    def __str__(self) -> str:
        return f"{self.where}: {self.why}"


@dataclasses.dataclass
class StepScan:
    """What was read of one step. ``stopped``: the reader was stopped (no progress, or the
    HDF5 library crashed), so the step could not be read to the end."""

    ref: StepRef
    committed: bool
    reason: str | None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    ranks: dict[int, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    rank_info: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    problems: list[Bad] = dataclasses.field(default_factory=list)
    checked: int = 0
    checked_bytes: int = 0
    stopped: bool = False

    @property
    def step(self) -> int | None:
        if self.ref.step is not None:
            return self.ref.step
        step = self.meta.get("step")
        return step if isinstance(step, int) and not isinstance(step, bool) else None

    @property
    def files(self) -> list[str]:
        return sorted(p.name for p in self.ref.dir.glob("*.h5") if h5files.step_file(p.name))

    def add(self, where: str, why: str) -> None:
        """Record a problem once (ranks in one damaged node file all hit the same one)."""
        bad = Bad(where, why)
        if bad not in self.problems:
            self.problems.append(bad)

    def to_json(self) -> dict[str, Any]:
        """What the sandboxed reader sends back (``ref`` stays with the parent)."""
        return {"committed": self.committed, "reason": self.reason, "meta": self.meta,
                "ranks": [[r, e] for r, e in self.ranks.items()],
                "rank_info": [[r, i] for r, i in self.rank_info.items()],
                "problems": [[p.where, p.why] for p in self.problems],
                "checked": self.checked, "checked_bytes": self.checked_bytes}

    @classmethod
    def from_json(cls, ref: StepRef, doc: dict[str, Any]) -> StepScan:
        return cls(ref, doc["committed"], doc["reason"], doc["meta"],
                   {r: e for r, e in doc["ranks"]}, {r: i for r, i in doc["rank_info"]},
                   [Bad(w, y) for w, y in doc["problems"]], doc["checked"],
                   doc["checked_bytes"])


def _why(exc: BaseException) -> str:
    """An exception as text (KeyError's str() adds quotes)."""
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc) or type(exc).__name__


def block_slices(shape: Sequence[int], itemsize: int, block_bytes: int = BLOCK_BYTES
                 ) -> Iterator[tuple[Any, ...]]:
    """Index tuples that read an array of ``shape`` in C order in pieces of at most about
    ``block_bytes`` (slices along the outermost axis whose inner part fits a block)."""
    inner, k = max(1, itemsize), len(shape) - 1
    while k > 0 and inner * shape[k] <= block_bytes:
        inner *= shape[k]
        k -= 1
    step = max(1, block_bytes // inner)
    for outer in np.ndindex(*shape[:k]):
        for start in range(0, shape[k], step):
            yield (*outer, slice(start, start + step))


def iter_blocks(ds: Any, block_bytes: int = BLOCK_BYTES) -> Iterator[np.ndarray]:
    """A dataset's bytes in C order as flat uint8 arrays of at most about ``block_bytes``."""
    shape = ds.shape
    if shape is None:                                  # HDF5 null dataspace
        return
    if len(shape) == 0 or ds.nbytes <= block_bytes:
        yield _raw(ds[()])
        return
    for index in block_slices(shape, ds.dtype.itemsize, block_bytes):
        yield _raw(ds[index])


def dataset_checksum(ds: Any, block_bytes: int = BLOCK_BYTES,
                     on_block: Callable[[int], None] | None = None,
                     sums: BlockSums | None = None) -> str:
    """xxh3-64 of a dataset's bytes in C order (the value :func:`ftkit.storage.shard.checksum`
    gives for the whole array), read in blocks of about ``block_bytes``; ``on_block(n)``
    after each block of ``n`` bytes; ``sums`` also fed every byte (block checksums)."""
    h = xxhash.xxh3_64()
    for block in iter_blocks(ds, block_bytes):
        h.update(block.data)
        if sums is not None:
            sums.update(block.data)
        if on_block is not None:
            on_block(block.nbytes)
    return "xxh3-64:" + h.hexdigest()


def _block_mismatch(entry: dict[str, Any], sums: BlockSums | None) -> str | None:
    """Which recorded block checksum the data does not have (None: all agree)."""
    if sums is None:
        return None
    got, want = sums.done(), entry["blocks"][1]
    bad = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
               None if len(got) == len(want) else min(len(got), len(want)))
    return None if bad is None else f"block {bad} does not match its block checksum"


def _entry(entry: dict[str, Any], file: Path | str) -> dict[str, Any]:
    """The JSON description of one verified tensor entry (:class:`h5group.RankGroup`)."""
    return {"path": entry["path"], "dtype": entry["dtype"], "kind": entry["kind"],
            "shape": entry["shape"], "nbytes": entry["nbytes"], "checksum": entry["checksum"],
            "index": entry["index"], "file": str(file), "dataset": entry["name"],
            "shard": entry["shard"], "key": entry["key"]}


def _rank_key(name: str) -> tuple[int, str]:
    return (int(name), "") if _RANK.fullmatch(name) else (1 << 62, name)


def _compact(numbers: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    nums = sorted(numbers)
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ", ".join(out)


class Progress:
    """A one-line counter on stderr (at most 10 updates a second), shown only when stdout and
    stderr are terminals; fed by the reader's reports."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled = label, enabled
        self.count = self.nbytes = 0
        self._shown = 0.0

    def add(self, nbytes: int, datasets: int = 1) -> None:
        self.count += datasets
        self.nbytes += nbytes
        now = time.monotonic()
        if self.enabled and now - self._shown >= 0.1:
            self._shown = now
            sys.stderr.write(f"\r{self.label}: {self.count} datasets, "
                             f"{human(self.nbytes)}\x1b[K")
            sys.stderr.flush()

    def done(self) -> None:
        if self.enabled and self._shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def _progress_enabled(as_json: bool) -> bool:
    return not as_json and sys.stdout.isatty() and sys.stderr.isatty()


def open_step(ref: StepRef) -> Any:
    """A :class:`StepReader` over ``ref``: the step's index, checked against the step's
    COMMITTED digests when it has them, or the one file PATH named."""
    from ftkit.storage.pfs.h5read import StepReader
    return StepReader(ref.dir, ref.step, file=None if ref.own_index else ref.h5)


def scan(ref: StepRef, *, tensors: bool = False, verify: bool = False,
         report: Reporter | None = None) -> StepScan:
    """Read one step: index attributes; with ``tensors`` every rank's tensor entries and
    structural checks; with ``verify`` also every dataset's checksum. Nothing is used before
    it is verified (:mod:`ftkit.storage.pfs.h5read`). Problems are recorded, never raised;
    ``report`` hears what is read. Run it in a sandbox: a damaged file can hang or crash
    the HDF5 library."""
    rep: Reporter = report or _Silent()
    committed, reason = ref.state()
    sc = StepScan(ref, committed, reason)
    if not os.path.lexists(ref.h5):
        return sc
    rep.progress(str(ref.h5))
    try:
        with open_step(ref) as reader:
            sc.meta = dict(reader.meta)
            if tensors or verify:
                _scan_ranks(sc, reader, verify, rep)
    except CorruptCheckpointError as exc:
        sc.add(exc.path, exc.reason)
    except Exception as exc:  # noqa: BLE001 - any library error is a damaged file
        sc.add(str(ref.h5), f"cannot read: {type(exc).__name__}: {_why(exc)}")
    return sc


def rank_names(reader: Any) -> list[str]:
    """Member names of the file's plain ``/rank`` group, ranks first in numeric order
    (CorruptCheckpointError when there is none)."""
    h5py = h5py_module()
    top = reader.h5.get("rank", getlink=True)
    grp = reader.h5.get("rank") if isinstance(top, h5py.HardLink) else None
    if not isinstance(grp, h5py.Group):
        raise CorruptCheckpointError(str(reader.path), "no plain /rank group: not an ftkit "
                                     "checkpoint file", step=reader.step, level="pfs")
    return sorted(grp, key=_rank_key)


def link_target(reader: Any, name: str) -> str:
    """``file:/object`` that ``/rank/<name>`` of the open file leads to (for messages)."""
    link = reader.h5["rank"].get(name, getlink=True)
    target = getattr(link, "filename", None)
    if isinstance(target, str):
        return f"{reader.step_dir / target}:{link.path}"
    return f"{reader.path}:/rank/{name}"


def _scan_ranks(sc: StepScan, reader: Any, verify: bool, rep: Reporter) -> None:
    names = rank_names(reader)
    world = sc.meta.get("world")
    linked = [int(n) for n in names if _RANK.fullmatch(n)]
    if isinstance(world, int) and (len(linked) != world or linked != list(range(world))):
        sc.add(f"{reader.path}:/rank", f"links ranks [{_compact(linked)}] but world is {world}")
    for name in names:
        where = f"{reader.path}:/rank/{name}"
        if not _RANK.fullmatch(name):
            sc.add(where, "not a rank number")
            continue
        rep.progress(link_target(reader, name))
        try:
            group = reader.group(int(name))
        except CorruptCheckpointError as exc:
            sc.add(exc.path, exc.reason)
            continue
        _scan_rank(sc, int(name), group, verify, rep)


def _scan_rank(sc: StepScan, rank: int, group: Any, verify: bool, rep: Reporter) -> None:
    sc.rank_info[rank] = {"file": group.file, **group.topology}
    sc.ranks[rank] = [_entry(e, group.file) for e in group.entries]
    if not verify:
        return
    for entry, ds in zip(group.entries, group.datasets):
        ds_where = f"{group.file}:{ds.name}"
        rep.progress(ds_where)
        sums = BlockSums(entry["blocks"][0]) if entry["blocks"] else None
        try:
            got = dataset_checksum(ds, on_block=lambda n: rep.progress(nbytes=n), sums=sums)
        except Exception as exc:  # noqa: BLE001 - any library error: unreadable
            sc.add(ds_where, f"unreadable data: {type(exc).__name__}: {_why(exc)}")
            continue
        if got != entry["checksum"]:
            sc.add(ds_where, f"checksum mismatch: stored {entry['checksum']}, data has {got}")
        elif (why := _block_mismatch(entry, sums)) is not None:
            sc.add(ds_where, why)
        sc.checked += 1
        sc.checked_bytes += entry["nbytes"]
        rep.progress(datasets=1)


