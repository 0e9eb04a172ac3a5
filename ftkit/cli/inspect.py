"""``ftkit inspect`` / ``verify`` / ``export``: the PFS level's HDF5 checkpoints (DESIGN §5, §7).

They run on a login node: importing this module imports neither mpi4py, torch nor h5py (h5py
on first use, torch only inside ``export``).

PATH names a job directory (``$FTKIT_PFS_DIR/<job>``, whose ``step-<s>`` directories are the
steps), one ``step-<s>`` directory, or one HDF5 file of a step (normally ``ftkit.h5``; a
``node-<id>.h5`` file works too). A step is *committed* when both ``step-<s>/COMMITTED`` and
its index ``ftkit.h5`` exist; otherwise it is *incomplete* (a flush that crashed or is still
running; restore ignores it).

``inspect PATH [--step S] [--json]`` lists the steps and, for one step (``--step``, the step PATH
names, or by default the newest committed one), every tensor of every rank. ``--json`` prints::

    {"path": str,                        # PATH as given
     "job_dir": str | null,              # job directory (null: PATH is not under one)
     "selected_step": int | null,        # the step whose "ranks" are listed
     "steps": [                          # every step, oldest first
       {"step": int | null, "dir": str,
        "committed": bool, "state": "committed" | "incomplete",
        "reason": str | null,            # why the step is incomplete
        "world": int | null, "dp": int | null, "tp": int | null, "pp": int | null,
        "nodes": int | null, "job": str | null, "time": float | null,   # index attributes
        "format": str | null, "files": [str],        # node files in the step directory
        "problems": [str],               # "<file>:<object>: <why>" found while reading
        "ranks": null | {                # null except for the selected step
          "<r>": [{"path": str,          # path in the state tree (ftkit_path)
                   "dtype": str,         # ftkit_dtype: torch name ("bfloat16") or numpy descr
                   "kind": "torch" | "numpy",
                   "shape": [int], "nbytes": int, "checksum": str, "index": int,
                   "file": str, "dataset": str,   # node file and /rank/<r>/... object
                   "shard": null | {"dim": int, "offset": int, "global_shape": [int]}}]}}]}

``verify PATH [--step S] [--json]`` recomputes the checksum of every dataset of the chosen
step (``--step``, the step PATH names, or every step of the job directory), following the
index's links, and checks the structure (every rank linked and readable, one dataset per
tensor of the rank's tree). Exit 0: intact; 1: a dataset is corrupt or unreadable or a step is
incomplete, each listed as ``<file>:/rank/<r>/<path>: <why>``; 2: usage error. ``--json``
prints ``{"path", "job_dir", "ok", "steps": [{"step", "dir", "committed", "state", "reason",
"ok", "datasets", "bytes", "bad": [{"where", "why"}]}]}``.

``export PATH --step S --out FILE [--format pt|safetensors]`` writes the state of one committed
step as a single-process flat dict ``{state path: tensor}`` (exact dtypes, bfloat16 included):
``pt`` with ``torch.save`` (loads with ``torch.load(..., weights_only=True)``), ``safetensors``
when that package is installed (default: from FILE's suffix). A data-parallel checkpoint
(tp = pp = 1) holds identical replicas: rank 0's tensors are exported. With tp or pp > 1 the
shards of the ``dp_idx == 0`` ranks are merged along ``shard_dim`` at ``shard_offset``; a tensor
held by several of them without shard attributes (``shard_dim == -1``) is an error naming it.
Non-tensor leaves (ints, floats, strings of the tree) are not exported. Exit 0: written;
1: the step is incomplete, corrupt or cannot be merged; 2: usage error.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ftkit.storage.hdf5 import FORMAT, INDEX
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
        if _is_step_dir(path):
            ref = StepRef(_step_number(path), path, path / INDEX)
            return Target(path, _job_of(path), [ref], True)
        steps = _step_dirs(path)
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


def _raw(a: Any) -> np.ndarray:
    """The bytes of an array read from a dataset, as a flat uint8 array."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


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


def _entry(ds: Any, file: Path) -> dict[str, Any]:
    """The JSON description of one tensor dataset (raises KeyError etc. on bad attributes)."""
    a = ds.attrs
    dim = int(a.get("shard_dim", -1))
    shard = None if dim < 0 else {"dim": dim, "offset": int(a["shard_offset"]),
                                  "global_shape": [int(x) for x in a["global_shape"]]}
    return {"path": str(a["ftkit_path"]), "dtype": str(a["ftkit_dtype"]),
            "kind": str(a["ftkit_kind"]), "shape": [int(x) for x in a["ftkit_shape"]],
            "nbytes": int(ds.nbytes), "checksum": str(a["checksum"]),
            "index": int(a["ftkit_index"]), "file": str(file), "dataset": str(ds.name),
            "shard": shard}


def _datasets(grp: Any) -> list[Any]:
    out: list[Any] = []
    grp.visititems(lambda _n, obj: out.append(obj) if hasattr(obj, "dtype") else None)
    return out


def _count_tensors(node: Any) -> int:
    if isinstance(node, dict):
        return (node.get("t") == "tensor") + sum(_count_tensors(v) for v in node.values())
    if isinstance(node, list):
        return sum(_count_tensors(v) for v in node)
    return 0


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
    """A one-line counter on stderr, shown only when stdout and stderr are terminals."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled = label, enabled
        self.count = self.nbytes = 0

    def add(self, nbytes: int) -> None:
        self.count += 1
        self.nbytes += nbytes
        if self.enabled:
            sys.stderr.write(f"\r{self.label}: {self.count} datasets, "
                             f"{_human(self.nbytes)}\x1b[K")
            sys.stderr.flush()

    def done(self) -> None:
        if self.enabled and self.count:
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()


def _progress_enabled(as_json: bool) -> bool:
    return not as_json and sys.stdout.isatty() and sys.stderr.isatty()


def scan(ref: StepRef, *, tensors: bool = False, verify: bool = False,
         progress: Progress | None = None) -> StepScan:
    """Read one step: index attributes; with ``tensors`` every rank's tensor entries and
    structural checks; with ``verify`` also every dataset's checksum. Problems are recorded,
    never raised."""
    committed, reason = ref.state()
    sc = StepScan(ref, committed, reason)
    if not ref.h5.is_file():
        return sc
    h5py = _h5py()
    try:
        with h5py.File(ref.h5, "r") as h5:
            sc.meta = {k: _py(v) for k, v in h5.attrs.items()}
            fmt = sc.meta.get("format")
            if fmt != FORMAT:
                why = (f"format {fmt!r}, expected {FORMAT!r}" if fmt is not None
                       else "no 'format' attribute: not an ftkit checkpoint file")
                sc.problems.append(Bad(str(ref.h5), why))
            if tensors or verify:
                _scan_ranks(sc, h5, h5py, verify, progress)
    except OSError as exc:
        sc.problems.append(Bad(str(ref.h5), f"cannot read: {exc}"))
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
        except (KeyError, OSError, ValueError) as exc:
            target = (f"{link.filename}:{link.path}" if isinstance(link, h5py.ExternalLink)
                      else name)
            sc.problems.append(Bad(where, f"link to {target} does not resolve ({_why(exc)})"))
            continue
        _scan_rank(sc, rank, grp, file, verify, progress)


def _scan_rank(sc: StepScan, rank: int, grp: Any, file: Path, verify: bool,
               progress: Progress | None) -> None:
    where = f"{file}:{grp.name}"
    try:
        attrs = {k: _py(v) for k, v in grp.attrs.items()}
        datasets = _datasets(grp)
    except (KeyError, OSError, ValueError, RuntimeError) as exc:
        sc.problems.append(Bad(where, f"unreadable rank group: {_why(exc)}"))
        return
    if attrs.get("rank") != rank:
        sc.problems.append(Bad(where, f"group says rank {attrs.get('rank')}, linked as {rank}"))
    if sc.step is not None and attrs.get("step") != sc.step:
        sc.problems.append(Bad(where, f"group says step {attrs.get('step')}, expected {sc.step}"))
    try:
        topo = json.loads(attrs.get("topology", "{}"))
        expected = _count_tensors(json.loads(attrs["tree"]))
    except (KeyError, TypeError, ValueError) as exc:
        sc.problems.append(Bad(where, f"bad 'tree'/'topology' attribute: {_why(exc)}"))
        topo, expected = {}, None
    sc.rank_info[rank] = {"file": str(file), **(topo if isinstance(topo, dict) else {})}
    entries = []
    for ds in datasets:
        ds_where = f"{file}:{ds.name}"
        try:
            entry = _entry(ds, file)
        except (KeyError, OSError, ValueError, TypeError) as exc:
            sc.problems.append(Bad(ds_where, f"unreadable attributes: {_why(exc)}"))
            continue
        entries.append(entry)
        if not verify:
            continue
        try:
            got = dataset_checksum(ds)
        except (OSError, ValueError, TypeError, RuntimeError) as exc:
            sc.problems.append(Bad(ds_where, f"unreadable data: {_why(exc)}"))
            continue
        if not entry["checksum"].startswith("xxh3-64:"):
            sc.problems.append(Bad(ds_where, f"unknown checksum {entry['checksum']!r}"))
        elif got != entry["checksum"]:
            sc.problems.append(Bad(ds_where, f"checksum mismatch: stored {entry['checksum']}, "
                                             f"data has {got}"))
        sc.checked += 1
        sc.checked_bytes += entry["nbytes"]
        if progress is not None:
            progress.add(entry["nbytes"])
    entries.sort(key=lambda e: e["index"])
    sc.ranks[rank] = entries
    if expected is not None:
        have = [e["index"] for e in entries]
        missing = sorted(set(range(expected)) - set(have))
        if missing or len(have) != expected:
            sc.problems.append(Bad(where, f"its tree has {expected} tensors but it holds "
                                          f"{len(have)} datasets"
                                          + (f" (missing ftkit_index {_compact(missing)})"
                                             if missing else "")))


# --------------------------------------------------------------------------- output helpers

def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _fmt(value: Any) -> str:
    return "-" if value is None else str(value)


def _when(ts: Any) -> str:
    if not isinstance(ts, (int, float)):
        return "-"
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _rich() -> Any:
    """The ``rich`` package when installed and stdout is a terminal, else None."""
    if not sys.stdout.isatty():
        return None
    try:
        import rich.box
        import rich.console
        import rich.table
    except ImportError:
        return None
    return rich


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, indent: str = "",
           title: str | None = None, right: Sequence[int] = ()) -> None:
    """Print a table: with ``rich`` on a terminal, else as plain aligned text."""
    rich = _rich()
    if rich is not None:
        t = rich.table.Table(title=title, title_justify="left", box=rich.box.SIMPLE)
        for i, h in enumerate(headers):
            t.add_column(h, justify="right" if i in right else "left")
        for row in rows:
            t.add_row(*row)
        rich.console.Console().print(t)
        return
    if title:
        print(title)
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    for row in [list(headers), *rows]:
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        print(indent + "  ".join(cells).rstrip())


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1))


# --------------------------------------------------------------------------- inspect

def _step_json(sc: StepScan, with_ranks: bool) -> dict[str, Any]:
    m = sc.meta
    return {"step": sc.step, "dir": str(sc.ref.dir), "committed": sc.committed,
            "state": "committed" if sc.committed else "incomplete", "reason": sc.reason,
            **{k: m.get(k) for k in ("world", "dp", "tp", "pp", "nodes", "job", "time",
                                     "format")},
            "files": sc.files, "problems": [str(p) for p in sc.problems],
            "ranks": ({str(r): e for r, e in sorted(sc.ranks.items())} if with_ranks
                      else None)}


def cmd_inspect(args: argparse.Namespace) -> int:
    target = resolve(args.path)
    chosen = target.pick(args.step) if args.step is not None or target.single else \
        target.newest()
    scans = [scan(ref, tensors=ref == chosen) for ref in target.steps]
    if args.json:
        _print_json({"path": str(target.path),
                     "job_dir": None if target.job_dir is None else str(target.job_dir),
                     "selected_step": None if chosen is None else
                     next(s.step for s in scans if s.ref == chosen),
                     "steps": [_step_json(s, s.ref == chosen) for s in scans]})
        return OK
    _render_inspect(target, scans, chosen)
    return OK


def _render_inspect(target: Target, scans: list[StepScan], chosen: StepRef | None) -> None:
    if target.job_dir is not None:
        jobs = {s.meta.get("job") for s in scans} - {None}
        print(f"job directory {target.job_dir}"
              + (f" (job {', '.join(sorted(map(str, jobs)))})" if jobs else ""))
    if not scans:
        print("no steps")
        return
    rows = []
    for s in scans:
        m = s.meta
        rows.append([_fmt(s.step), "committed" if s.committed else "incomplete",
                     *(_fmt(m.get(k)) for k in ("world", "dp", "tp", "pp", "nodes")),
                     _when(m.get("time")), s.reason or ""])
    _table(["step", "state", "world", "dp", "tp", "pp", "nodes", "written", "note"], rows,
           right=(0, 2, 3, 4, 5, 6))
    for s in scans:
        if s.ref == chosen:
            print()
            _render_step(s)


def _render_step(sc: StepScan) -> None:
    state = "committed" if sc.committed else f"incomplete: {sc.reason}"
    print(f"{sc.ref.label} ({state}): {len(sc.ranks)} rank(s) in {sc.ref.dir}")
    previous: tuple[Any, ...] | None = None
    shown = -1                      # the last rank printed in full
    same: list[int] = []            # the ranks after it with the same layout

    def flush_same() -> None:
        if same:
            n = len(sc.ranks[same[0]])
            size = sum(e["nbytes"] for e in sc.ranks[same[0]])
            print(f"rank(s) {_compact(same)}: same paths, dtypes and shapes as rank {shown} "
                  f"({n} tensors, {_human(size)} each; --json lists every rank)")
            same.clear()

    for rank, entries in sorted(sc.ranks.items()):
        layout = tuple((e["path"], e["dtype"], tuple(e["shape"])) for e in entries)
        if layout == previous:
            same.append(rank)
            continue
        flush_same()
        previous, shown = layout, rank
        info = sc.rank_info.get(rank, {})
        coords = " ".join(f"{k[:-4]} {info[k]}" for k in ("dp_idx", "tp_idx", "pp_idx")
                          if k in info)
        rows = [[e["path"], e["dtype"], str(e["shape"]), str(e["nbytes"])] for e in entries]
        total = sum(e["nbytes"] for e in entries)
        _table(["path", "dtype", "shape", "bytes"], rows, indent="  ", right=(3,),
               title=f"rank {rank}  {Path(info.get('file', '?')).name}  {coords}".rstrip())
        print(f"  {len(entries)} tensors, {_human(total)}")
    flush_same()
    if sc.problems:
        print("problems:")
        for p in sc.problems:
            print(f"  {p}")


# --------------------------------------------------------------------------- verify

def cmd_verify(args: argparse.Namespace) -> int:
    target = resolve(args.path)
    refs = [target.pick(args.step)] if args.step is not None or target.single else target.steps
    results = []
    for ref in refs:
        if not ref.state()[0]:
            sc = StepScan(ref, *ref.state())
            sc.problems.append(Bad(str(ref.dir), f"incomplete: {sc.reason}"))
        else:
            progress = Progress(f"verify {ref.label}", _progress_enabled(args.json))
            sc = scan(ref, verify=True, progress=progress)
        results.append(sc)
    ok = bool(results) and not any(s.problems for s in results)
    if args.json:
        _print_json({"path": str(target.path),
                     "job_dir": None if target.job_dir is None else str(target.job_dir),
                     "ok": ok,
                     "steps": [{"step": s.step, "dir": str(s.ref.dir), "committed": s.committed,
                                "state": "committed" if s.committed else "incomplete",
                                "reason": s.reason, "ok": not s.problems,
                                "datasets": s.checked, "bytes": s.checked_bytes,
                                "bad": [dataclasses.asdict(p) for p in s.problems]}
                               for s in results]})
        return OK if ok else BAD
    for s in results:
        if not s.problems:
            print(f"{s.ref.label}: ok ({s.checked} datasets, {_human(s.checked_bytes)})")
            continue
        print(f"{s.ref.label}: {'BAD' if s.committed else 'INCOMPLETE'}")
        for p in s.problems:
            print(f"  {p}")
    if not results:
        print(f"ftkit verify: no steps in {target.path}")
    elif ok:
        print(f"ftkit verify: {len(results)} step(s) intact")
    else:
        nbad = sum(1 for s in results if s.problems)
        print(f"ftkit verify: {nbad} of {len(results)} step(s) corrupt or incomplete")
    return OK if ok else BAD


# --------------------------------------------------------------------------- export

Piece = tuple[dict[str, Any], np.ndarray]          # (tensor entry, raw uint8 bytes)


def _read_rank(h5: Any, ref: StepRef, rank: int) -> tuple[dict[str, Any], list[Piece]]:
    """(group attrs, [(entry, raw)] in tree order) of one rank, checksums verified."""
    h5py = _h5py()
    link = h5["rank"].get(str(rank), getlink=True)
    if link is None:
        raise ExportError(f"{ref.h5}: rank {rank} is not linked")
    file = ref.h5.parent / link.filename if isinstance(link, h5py.ExternalLink) else ref.h5
    try:
        grp = h5[f"rank/{rank}"]
        attrs = {k: _py(v) for k, v in grp.attrs.items()}
        pieces = []
        for ds in _datasets(grp):
            entry = _entry(ds, file)
            raw = _raw(ds[()])
            if checksum(raw) != entry["checksum"]:
                raise ExportError(f"{file}:{ds.name}: checksum mismatch (stored "
                                  f"{entry['checksum']}, data has {checksum(raw)})")
            pieces.append((entry, raw))
    except (KeyError, OSError, ValueError, TypeError) as exc:
        raise ExportError(f"{file}:/rank/{rank}: cannot read: {_why(exc)}") from exc
    pieces.sort(key=lambda p: p[0]["index"])
    return attrs, pieces


def _assemble(path: str, held: list[tuple[int, Piece]]) -> Piece:
    """Merge the shards of one tensor along ``shard_dim`` (ExportError when impossible)."""
    ranks = [r for r, _ in held]
    shards = [p[0]["shard"] for _, p in held]
    if any(s is None for s in shards):
        raise ExportError(
            f"cannot export tensor {path!r}: ranks {_compact(ranks)} each hold it without "
            f"shard attributes (shard_dim -1), so ftkit cannot tell TP/PP shards from "
            f"replicas; only data-parallel (tp = pp = 1) checkpoints or tensors with "
            f"shard_dim/shard_offset/global_shape can be exported")
    dims = {s["dim"] for s in shards}
    gshapes = {tuple(s["global_shape"]) for s in shards}
    dtypes = {p[0]["dtype"] for _, p in held}
    if len(dims) != 1 or len(gshapes) != 1 or len(dtypes) != 1:
        raise ExportError(f"cannot export tensor {path!r}: its shards on ranks "
                          f"{_compact(ranks)} disagree on shard_dim {sorted(dims)}, "
                          f"global_shape {sorted(gshapes)} or dtype {sorted(dtypes)}")
    dim, gshape = dims.pop(), list(gshapes.pop())
    if not 0 <= dim < len(gshape):
        raise ExportError(f"cannot export tensor {path!r}: shard_dim {dim} outside its "
                          f"global shape {gshape}")
    by_offset: dict[int, tuple[int, Piece]] = {}
    for rank, (entry, raw) in held:
        off = entry["shard"]["offset"]
        other = by_offset.get(off)
        if other is not None and other[1][0]["checksum"] != entry["checksum"]:
            raise ExportError(f"cannot export tensor {path!r}: ranks {other[0]} and {rank} "
                              f"hold different shards at offset {off} of dimension {dim}")
        by_offset.setdefault(off, (rank, (entry, raw)))
    blocks, pos = [], 0
    for off, (rank, (entry, raw)) in sorted(by_offset.items()):
        shape = entry["shape"]
        if (off != pos or len(shape) != len(gshape)
                or shape[:dim] + shape[dim + 1:] != gshape[:dim] + gshape[dim + 1:]):
            raise ExportError(f"cannot export tensor {path!r}: the shard of rank {rank} "
                              f"(shape {shape}, offset {off}) does not continue the "
                              f"{gshape} tensor at {pos} along dimension {dim}")
        count = math.prod(shape)
        item = raw.nbytes // count if count else 1
        blocks.append(raw.reshape(*shape, item))
        pos += shape[dim]
    if pos != gshape[dim]:
        raise ExportError(f"cannot export tensor {path!r}: shards cover {pos} of "
                          f"{gshape[dim]} along dimension {dim}")
    merged = _raw(np.concatenate(blocks, axis=dim))
    first = held[0][1][0]
    return {**first, "shape": gshape, "nbytes": merged.nbytes, "shard": None}, merged


def _merge_ranks(h5: Any, ref: StepRef, world: int, tp: int, pp: int
                 ) -> tuple[list[Piece], str]:
    """The single-process tensors of a TP/PP checkpoint, merged from the dp_idx 0 ranks."""
    held: dict[str, list[tuple[int, Piece]]] = {}
    used = []
    for rank in range(world):
        attrs, pieces = _read_rank(h5, ref, rank)
        topo = json.loads(attrs.get("topology", "{}"))
        dp_idx = topo.get("dp_idx", (rank // tp) % max(1, world // (tp * pp)))
        if dp_idx != 0:
            continue
        used.append(rank)
        for piece in pieces:
            held.setdefault(piece[0]["path"], []).append((rank, piece))
    out = [items[0][1] if len(items) == 1 and items[0][1][0]["shard"] is None
           else _assemble(path, items) for path, items in held.items()]
    return out, f"merged from ranks {_compact(used)} (tp {tp}, pp {pp}, world {world})"


def _to_torch(entry: dict[str, Any], raw: np.ndarray) -> Any:
    """A torch tensor (own memory) for one tensor entry, or None if torch has no such dtype."""
    import torch

    from ftkit.capture.flatten import TensorLeaf, leaf_from_bytes
    leaf = TensorLeaf(entry["path"], entry["kind"], entry["dtype"], tuple(entry["shape"]),
                      raw.nbytes)
    if not raw.flags.writeable:
        raw = raw.copy()
    try:
        value = leaf_from_bytes(leaf, raw)
    except (AttributeError, TypeError, ValueError) as exc:
        raise ExportError(f"cannot rebuild tensor {entry['path']!r} ({entry['kind']} dtype "
                          f"{entry['dtype']}, shape {entry['shape']}): {exc}") from exc
    if isinstance(value, torch.Tensor):
        return value.clone()
    arr = np.asarray(value)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    try:
        return torch.from_numpy(np.array(arr, copy=True))
    except TypeError:
        return None


def _save(fmt: str, tensors: dict[str, Any], out: Path, meta: dict[str, str]) -> None:
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file
            save_file(tensors, str(tmp), metadata=meta)
        else:
            import torch
            torch.save(tensors, tmp)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _export_format(args: argparse.Namespace) -> str:
    fmt: str = args.format or ("safetensors" if args.out.endswith(".safetensors") else "pt")
    if fmt == "safetensors":
        try:
            import safetensors.torch  # noqa: F401
        except ImportError as exc:
            raise UsageError(f"--format safetensors needs the 'safetensors' package ({exc}); "
                             f"install it or use --format pt") from exc
    return fmt


def cmd_export(args: argparse.Namespace) -> int:
    target = resolve(args.path)
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: directory {out.parent} does not exist")
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory")
    fmt = _export_format(args)
    if args.step is None and not target.single:
        steps = ", ".join(str(r.step) for r in target.steps if r.state()[0]) or "none"
        raise UsageError(f"--step is required for a job directory (committed steps: {steps})")
    ref = target.pick(args.step)
    committed, reason = ref.state()
    if not committed:
        raise ExportError(f"{ref.label} in {ref.dir} is incomplete: {reason}")
    h5py = _h5py()
    try:
        with h5py.File(ref.h5, "r") as h5:
            meta = {k: _py(v) for k, v in h5.attrs.items()}
            world, tp, pp = (int(meta.get(k, 1)) for k in ("world", "tp", "pp"))
            if tp * pp == 1:
                _, pieces = _read_rank(h5, ref, 0)
                source = (f"rank 0 (data-parallel replicas, world {world})" if world > 1
                          else "rank 0")
            else:
                pieces, source = _merge_ranks(h5, ref, world, tp, pp)
    except OSError as exc:
        raise ExportError(f"{ref.h5}: cannot read: {exc}") from exc
    tensors: dict[str, Any] = {}
    skipped = []
    for entry, raw in pieces:
        value = _to_torch(entry, raw)
        if value is None:
            skipped.append(f"{entry['path']} ({entry['dtype']})")
            continue
        key = entry["path"] or f"_leaf/{entry['index']}"
        tensors[key if key not in tensors else f"{key}#{entry['index']}"] = value
    if skipped:
        print(f"ftkit export: skipped {len(skipped)} array(s) torch has no dtype for: "
              f"{', '.join(skipped)}", file=sys.stderr)
    _save(fmt, tensors, out, {"ftkit_job": str(meta.get("job", "")),
                              "ftkit_step": str(meta.get("step", ref.step)),
                              "ftkit_source": source})
    nbytes = sum(raw.nbytes for _, raw in pieces)
    print(f"ftkit export: {ref.label}: {len(tensors)} tensors ({_human(nbytes)}) from {source}"
          f" -> {out} ({fmt})")
    return OK


# --------------------------------------------------------------------------- entry

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "inspect": cmd_inspect, "verify": cmd_verify, "export": cmd_export}


def run(args: argparse.Namespace) -> int:
    """Run ``args.command`` (inspect/verify/export); returns the exit status."""
    try:
        return COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"ftkit {args.command}: error: {exc}", file=sys.stderr, flush=True)
        return USAGE
    except ExportError as exc:
        print(f"ftkit {args.command}: error: {exc}", file=sys.stderr, flush=True)
        return BAD

