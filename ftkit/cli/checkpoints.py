"""``ftkit inspect`` / ``verify`` / ``export``: the PFS level's HDF5 checkpoints (docs/formats.md).

(``inspect``/``verify`` of node-local steps: :mod:`ftkit.cli.localsteps`.)

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
                   "shard": null | {"dim": int | null, "offset": int | null,
                                    "global_shape": [int], "chunks": [[[int], [int]]]},
                   "key": null | str}]}}]}

``shard`` says where a declared shard (``ftkit.declare_shard``) lies in its global tensor:
``chunks`` are its boxes (offsets, sizes), ``dim``/``offset`` the one dimension and offset of a
single slice (null for several chunks or dimensions). ``key`` is the global name of optimizer
state (``optim/state/<parameter path>/<name>``), null for other tensors.

``verify PATH [--step S] [--json]`` recomputes the checksum of every dataset of the chosen
step (``--step``, the step PATH names, or every step of the job directory), following the
index's links, and checks the structure (every rank linked and readable, one dataset per
tensor of the rank's tree). Exit 0: intact; 1: a dataset is corrupt or unreadable or a step is
incomplete, each listed as ``<file>:/rank/<r>/<path>: <why>``; 2: usage error. ``--json``
prints ``{"path", "job_dir", "ok", "steps": [{"step", "dir", "committed", "state", "reason",
"ok", "datasets", "bytes", "bad": [{"where", "why"}]}]}``.

``export PATH --step S --out FILE [--format pt|safetensors]`` writes the state of one committed
step as a single-process flat dict ``{name: tensor}`` (name: the tensor's ``key`` where it has
one, else its state path; exact dtypes, bfloat16 included):
``pt`` with ``torch.save`` (loads with ``torch.load(..., weights_only=True)``), ``safetensors``
written by ftkit itself (default: from FILE's suffix), streaming tensor by tensor
(:mod:`ftkit.cli.export`). A data-parallel checkpoint
(tp = pp = 1) holds identical replicas: rank 0's tensors are exported. With tp or pp > 1 the
declared shards of the ``dp_idx == 0`` ranks are assembled into their global tensors (they must
cover each exactly once); a tensor several of them hold without shard attributes
(``shard_dim == -1``) is a replica when the step declares shards elsewhere and every copy is
equal, else an error naming it; RNG state (``ftkit.RNGState``, every rank's own) is the lowest
rank's.
Non-tensor leaves (ints, floats, strings of the tree) are not exported; every tensor leaf is
(one torch has no dtype for is an error). Exit 0: written; 1: the step is incomplete, corrupt,
unreadable or cannot be merged (nothing written); 2: usage error.

All three read in a sandboxed child (:mod:`ftkit.cli.sandbox`): ``--timeout SECONDS``
(default ``FTKIT_TIMEOUT``) without progress stops it, and a crash of the HDF5 library is
reported with its signal; ``inspect`` then exits 1, ``verify`` reports the step as bad and
goes on with the others. PATH that is neither a regular file nor a directory: exit 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

OK, BAD, USAGE = 0, 1, 2

from ftkit.cli import sandbox
from ftkit.cli.export import cmd_export
from ftkit.cli.fmt import human
from ftkit.cli.scan import (
    Bad,
    BadInput,
    Progress,
    StepRef,
    StepScan,
    Target,
    UsageError,
    _compact,
    _progress_enabled,
    h5py_module,
    resolve,
    scan,
)

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- output helpers


def _fmt(value: Any) -> str:
    return "-" if value is None else str(value)


def _when(ts: Any) -> str:
    if not isinstance(ts, (int, float)):
        return "-"
    try:
        return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):      # a damaged 'time' attribute
        return f"? ({ts!r})"


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


def read_step(ref: StepRef, args: argparse.Namespace, *, tensors: bool = False,
              verify: bool = False, progress: Progress | None = None) -> StepScan:
    """:func:`scan` of one step in a sandboxed child (``args.timeout`` without progress stops
    it); a reader that stalled or crashed leaves a ``stopped`` scan with that problem."""
    def work(rep: sandbox.Reporter) -> dict[str, Any]:
        return scan(ref, tensors=tensors, verify=verify, report=rep).to_json()
    try:
        doc = sandbox.run(work, timeout=args.timeout, what=str(ref.h5),
                          on_progress=None if progress is None else progress.add)
    except sandbox.SandboxError as exc:
        sc = StepScan(ref, *ref.state(), stopped=True)
        sc.problems.append(Bad(exc.where, exc.why))
        return sc
    finally:
        if progress is not None:
            progress.done()
    return StepScan.from_json(ref, doc)


def _report_stopped(command: str, scans: list[StepScan]) -> bool:
    """One line on stderr per step whose reader was stopped; whether there was one."""
    for s in scans:
        if s.stopped:
            print(f"ftkit {command}: error: {s.ref.label}: {s.problems[-1]}", file=sys.stderr,
                  flush=True)
    return any(s.stopped for s in scans)


def cmd_inspect(args: argparse.Namespace) -> int:
    target = resolve(args.path)
    chosen = target.pick(args.step) if args.step is not None or target.single else \
        target.newest()
    scans = [read_step(ref, args, tensors=ref == chosen) for ref in target.steps]
    if args.json:
        _print_json({"path": str(target.path),
                     "job_dir": None if target.job_dir is None else str(target.job_dir),
                     "selected_step": None if chosen is None else
                     next(s.step for s in scans if s.ref == chosen),
                     "steps": [_step_json(s, s.ref == chosen) for s in scans]})
    else:
        _render_inspect(target, scans, chosen)
    return BAD if _report_stopped("inspect", scans) else OK


def _render_inspect(target: Target, scans: list[StepScan], chosen: StepRef | None) -> None:
    if target.job_dir is not None:
        jobs = {str(s.meta["job"]) for s in scans if s.meta.get("job") is not None}
        print(f"job directory {target.job_dir}"
              + (f" (job {', '.join(sorted(jobs))})" if jobs else ""))
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
                  f"({n} tensors, {human(size)} each; --json lists every rank)")
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
        print(f"  {len(entries)} tensors, {human(total)}")
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
            sc = read_step(ref, args, verify=True, progress=progress)
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
    _render_verify(target, results, ok)
    return OK if ok else BAD


def _render_verify(target: Target, results: list[StepScan], ok: bool) -> None:
    for s in results:
        if not s.problems:
            print(f"{s.ref.label}: ok ({s.checked} datasets, {human(s.checked_bytes)})")
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


# --------------------------------------------------------------------------- entry

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "inspect": cmd_inspect, "verify": cmd_verify, "export": cmd_export}


def _timeout(args: argparse.Namespace) -> float:
    """``--timeout``, else ``FTKIT_TIMEOUT`` (:class:`ftkit.config.Config`)."""
    if args.timeout is not None:
        return float(args.timeout)
    from ftkit.config import Config
    from ftkit.errors import ConfigError
    try:
        return Config.load().timeout
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc


def _node_local(args: argparse.Namespace) -> int | None:
    """inspect/verify of a node-local tree (:mod:`ftkit.cli.localsteps`); None for others."""
    from ftkit.cli import localsteps
    steps = localsteps.local_steps(Path(args.path))
    if steps is None:
        return None
    if args.command == "export":
        raise UsageError(f"{args.path} holds node-local steps; export reads PFS steps "
                         f"($FTKIT_PFS_DIR/<job>)")
    if args.command == "inspect":
        return localsteps.cmd_inspect_local(args, steps)
    return localsteps.cmd_verify_local(args, steps)


def run(args: argparse.Namespace) -> int:
    """Run ``args.command`` (inspect/verify/export); returns the exit status: 0 done,
    1 unusable input (corrupt, incomplete, not a regular file, a reader that stalled or
    crashed), 2 usage. Never a traceback: an unexpected error is one line too (its traceback
    at DEBUG level)."""
    try:
        local = _node_local(args)
        if local is not None:
            return local
        args.timeout = _timeout(args)
        h5py_module()               # imported once here, not in every sandboxed child
        return COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"ftkit {args.command}: error: {exc}", file=sys.stderr, flush=True)
        return USAGE
    except (BadInput, sandbox.SandboxError) as exc:
        print(f"ftkit {args.command}: error: {exc}", file=sys.stderr, flush=True)
        return BAD
    except BrokenPipeError:
        raise                       # the reader of stdout is gone (| head): ftkit.cli.main
    except Exception as exc:
        log.debug("ftkit %s failed", args.command, exc_info=True)
        print(f"ftkit {args.command}: error: {args.path}: unexpected {type(exc).__name__}: "
              f"{exc}", file=sys.stderr, flush=True)
        return BAD
