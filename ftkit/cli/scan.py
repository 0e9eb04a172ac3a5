"""Locate and read the steps of an HDF5 checkpoint (for ``ftkit inspect/verify/export``).

Imports h5py lazily; never mpi4py or torch.
"""
from __future__ import annotations

import dataclasses
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ftkit.errors import CorruptCheckpointError
from ftkit.storage import hdf5
from ftkit.storage.hdf5 import INDEX
from ftkit.storage.hdf5 import raw_bytes as _raw
from ftkit.storage.shard import checksum

OK, BAD, USAGE = 0, 1, 2
COMMIT_RECORD = "COMMITTED"
BLOCK_BYTES = 64 << 20          # verify reads datasets in blocks of about this size
_STEP_DIR = re.compile(r"step-(\d+)")
_EXPORT_FORMATS = ("pt", "safetensors")


class UsageError(Exception):
    """PATH, ``--step`` or an option cannot be used (exit status 2)."""


class ExportError(Exception):
    """The chosen step cannot be exported (exit status 1)."""


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as exc:  # pragma: no cover - h5py is a dependency
        raise UsageError(f"h5py is needed to read HDF5 checkpoints: {exc}") from exc
    return h5py


def _open(path: Path) -> Any:
    """Open an HDF5 file read-only without file locks (parallel file systems often refuse
    them; files of a step are renamed into place whole, so readers need none)."""
    return _h5py().File(path, "r", locking=False)


# --------------------------------------------------------------------------- locating steps

@dataclasses.dataclass(frozen=True)
class StepRef:
    """One step: its number (from ``step-<s>``; None if unknown), directory and the HDF5 file
    to open (``ftkit.h5``, or the file PATH named)."""

    step: int | None
    dir: Path
    h5: Path

    def state(self) -> tuple[bool, str | None]:
        """(committed, why not)."""
        missing = []
        if not (self.dir / COMMIT_RECORD).is_file():
            missing.append(f"no {COMMIT_RECORD} record")
        if not self.h5.is_file():
            missing.append(f"{self.h5.name} missing")
        if not missing:
            return True, None
        return False, " and ".join(missing) + " (a flush that crashed or is still running)"

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
    m = _STEP_DIR.fullmatch(directory.name)
    return int(m.group(1)) if m else None


def _step_dirs(directory: Path) -> list[tuple[int, Path]]:
    found = []
    for p in directory.iterdir():
        n = _step_number(p)
        if n is not None and p.is_dir():
            found.append((n, p))
    return sorted(found)


def _is_step_dir(directory: Path) -> bool:
    return (_step_number(directory) is not None or (directory / INDEX).exists()
            or (directory / COMMIT_RECORD).exists() or any(directory.glob("node-*.h5")))


def _job_of(step_dir: Path) -> Path | None:
    return step_dir.parent if _step_number(step_dir) is not None else None


def resolve(text: str) -> Target:
    """Interpret PATH (raises UsageError)."""
    path = Path(text)
    try:
        if not path.exists():
            raise UsageError(f"{path}: no such file or directory")
        if path.is_file():
            d = path.parent
            return Target(path, _job_of(d), [StepRef(_step_number(d), d, path)], True)
        if not path.is_dir():
            raise UsageError(f"{path}: not a file or directory")
        steps = _step_dirs(path)
        if not steps and _is_step_dir(path):
            ref = StepRef(_step_number(path), path, path / INDEX)
            return Target(path, _job_of(path), [ref], True)
        if steps or (path / "events.jsonl").is_file():
            return Target(path, path, [StepRef(n, d, d / INDEX) for n, d in steps], False)
        jobs = sorted(p.name for p in path.iterdir() if p.is_dir() and _step_dirs(p))
    except PermissionError as exc:
        raise UsageError(f"{path}: {exc.strerror}") from exc
    hint = f"; it holds the job directories {', '.join(jobs)}" if jobs else ""
    raise UsageError(f"{path}: neither a job directory (with step-<s> directories) nor a step "
                     f"directory{hint}")


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
    """What was read of one step."""

    ref: StepRef
    committed: bool
    reason: str | None
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    ranks: dict[int, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    rank_info: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    problems: list[Bad] = dataclasses.field(default_factory=list)
    checked: int = 0
    checked_bytes: int = 0

    @property
    def step(self) -> int | None:
        if self.ref.step is not None:
            return self.ref.step
        step = self.meta.get("step")
        return step if isinstance(step, int) else None

    @property
    def files(self) -> list[str]:
        return sorted(p.name for p in self.ref.dir.glob("node-*.h5"))


def _py(value: Any) -> Any:
    """An attribute value as plain Python (numbers, strings, lists)."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _why(exc: BaseException) -> str:
    """An exception as text (KeyError's str() adds quotes)."""
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc) or type(exc).__name__


def dataset_checksum(ds: Any, block_bytes: int = BLOCK_BYTES) -> str:
    """xxh3-64 of a dataset's bytes in C order (the value :func:`ftkit.storage.shard.checksum`
    gives for the whole array), read in blocks of about ``block_bytes`` along the first axis."""
    shape = ds.shape
    if shape is None:                                  # HDF5 null dataspace
        return checksum(b"")
    if len(shape) == 0 or ds.nbytes <= block_bytes:
        return checksum(_raw(ds[()]))
    h = xxhash.xxh3_64()
    rows = max(1, block_bytes // max(1, ds.nbytes // shape[0]))
    for start in range(0, shape[0], rows):
        h.update(_raw(ds[start:start + rows]).data)
    return "xxh3-64:" + h.hexdigest()


def _entry(entry: dict[str, Any], file: Path) -> dict[str, Any]:
    """The JSON description of one verified tensor entry (:class:`hdf5.RankGroup`)."""
    return {"path": entry["path"], "dtype": entry["dtype"], "kind": entry["kind"],
            "shape": entry["shape"], "nbytes": entry["nbytes"], "checksum": entry["checksum"],
            "index": entry["index"], "file": str(file), "dataset": entry["name"],
            "shard": entry["shard"]}


def _rank_key(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 62, name)


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
    stderr are terminals."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled = label, enabled
        self.count = self.nbytes = 0
        self._shown = 0.0

    def add(self, nbytes: int) -> None:
        self.count += 1
        self.nbytes += nbytes
        now = time.monotonic()
        if self.enabled and now - self._shown >= 0.1:
            self._shown = now
            sys.stderr.write(f"\r{self.label}: {self.count} datasets, "
                             f"{_human(self.nbytes)}\x1b[K")
            sys.stderr.flush()

    def done(self) -> None:
        if self.enabled and self._shown:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def _progress_enabled(as_json: bool) -> bool:
    return not as_json and sys.stdout.isatty() and sys.stderr.isatty()


def scan(ref: StepRef, *, tensors: bool = False, verify: bool = False,
         progress: Progress | None = None) -> StepScan:
    """Read one step: index attributes; with ``tensors`` every rank's tensor entries and
    structural checks; with ``verify`` also every dataset's checksum. Nothing is used before
    its metadata checksum is verified (:mod:`ftkit.storage.hdf5`). Problems are recorded,
    never raised."""
    committed, reason = ref.state()
    sc = StepScan(ref, committed, reason)
    if not ref.h5.is_file():
        return sc
    h5py = _h5py()
    try:
        with _open(ref.h5) as h5:
            sc.meta = {k: _py(v) for k, v in h5.attrs.items() if k != hdf5.META}
            try:
                hdf5.check_root(h5, str(ref.h5), step=ref.step)
            except CorruptCheckpointError as exc:
                sc.problems.append(Bad(exc.path, exc.reason))
            else:
                if tensors or verify:
                    _scan_ranks(sc, h5, h5py, verify, progress)
    except Exception as exc:  # noqa: BLE001 - any library error is a damaged file
        sc.problems.append(Bad(str(ref.h5), f"cannot read: {_why(exc)}"))
    if progress is not None:
        progress.done()
    return sc


def _scan_ranks(sc: StepScan, h5: Any, h5py: Any, verify: bool,
                progress: Progress | None) -> None:
    ref = sc.ref
    ranks = h5.get("rank")
    if ranks is None:
        sc.problems.append(Bad(str(ref.h5), "no /rank group: not an ftkit checkpoint file"))
        return
    names = sorted(ranks, key=_rank_key)
    world = sc.meta.get("world")
    linked = [int(n) for n in names if n.isdigit()]
    if isinstance(world, int) and sorted(linked) != list(range(world)):
        sc.problems.append(Bad(f"{ref.h5}:/rank", f"links ranks [{_compact(linked)}] but world "
                                                  f"is {world}"))
    for name in names:
        where = f"{ref.h5}:/rank/{name}"
        if not name.isdigit():
            sc.problems.append(Bad(where, "not a rank number"))
            continue
        rank = int(name)
        link = ranks.get(name, getlink=True)
        file = ref.h5
        if isinstance(link, h5py.ExternalLink):
            file = ref.h5.parent / link.filename
        try:
            grp = ranks[name]
        except Exception as exc:  # noqa: BLE001 - any library error: does not resolve
            target = (f"{link.filename}:{link.path}" if isinstance(link, h5py.ExternalLink)
                      else name)
            sc.problems.append(Bad(where, f"link to {target} does not resolve ({_why(exc)})"))
            continue
        try:
            group = hdf5.RankGroup.load(grp, file, rank=rank, step=sc.step,
                                        world=world if isinstance(world, int) else None)
        except CorruptCheckpointError as exc:
            sc.problems.append(Bad(exc.path, exc.reason))
            continue
        _scan_rank(sc, rank, group, file, verify, progress)


def _scan_rank(sc: StepScan, rank: int, group: hdf5.RankGroup, file: Path, verify: bool,
               progress: Progress | None) -> None:
    sc.rank_info[rank] = {"file": str(file), **group.topology}
    sc.ranks[rank] = [_entry(e, file) for e in group.entries]
    if not verify:
        return
    for entry, ds in zip(group.entries, group.datasets):
        ds_where = f"{file}:{ds.name}"
        try:
            got = dataset_checksum(ds)
        except Exception as exc:  # noqa: BLE001 - any library error: unreadable
            sc.problems.append(Bad(ds_where, f"unreadable data: {_why(exc)}"))
            continue
        if got != entry["checksum"]:
            sc.problems.append(Bad(ds_where, f"checksum mismatch: stored {entry['checksum']}, "
                                             f"data has {got}"))
        sc.checked += 1
        sc.checked_bytes += entry["nbytes"]
        if progress is not None:
            progress.add(entry["nbytes"])


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover
