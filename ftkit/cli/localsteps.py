"""``ftkit inspect`` / ``verify`` of node-local steps (``$FTKIT_LOCAL_DIR/<job>/node-<id>/``).

PATH may be a job's node-local directory (its ``node-<id>/`` directories), one ``node-<id>``
directory or one ``step-<s>`` directory of it. Every ``.ftk`` file is read by the hardened
shard parser (:class:`ftkit.storage.shard.Shard`: a symbolic link or FIFO is refused, nothing
in a header is trusted), in this process: no HDF5 library is involved, so no sandbox is
needed. ``inspect`` lists the steps per node with their files, and every tensor of every
rank shard of one step (``--step`` or the newest committed); ``verify`` recomputes every
tensor checksum of every file of the chosen steps (``--step``, or every committed step).
A step without ``COMMITTED`` is *tentative*: listed, verified only when ``--step`` or PATH
names it.
Both see this host's view: on a cluster every node holds its own.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

from ftkit.cli.fmt import human
from ftkit.errors import CorruptCheckpointError
from ftkit.storage.shard import Shard
from ftkit.storage.stepnames import step_dirs, step_number

_NODE = re.compile(r"^node-\d+$")


@dataclasses.dataclass
class LocalStep:
    """One ``step-<s>`` directory of one node."""

    node: str
    step: int
    dir: Path

    @property
    def committed(self) -> bool:
        return (self.dir / "COMMITTED").is_file()

    def files(self) -> list[Path]:
        return sorted(p for p in self.dir.iterdir() if p.name.endswith(".ftk"))


def _steps_of(node_dir: Path) -> list[LocalStep]:
    return [LocalStep(node_dir.name, step, path) for step, path in step_dirs(node_dir)]


def local_steps(path: Path) -> list[LocalStep] | None:
    """The node-local steps PATH names, oldest first; None when PATH is not a node-local
    tree (a PFS job or step directory, a file)."""
    if not path.is_dir() or path.is_symlink():
        return None
    names = [e.name for e in os.scandir(path)]
    step = step_number(path.name)
    if step is not None and any(n.endswith(".ftk") for n in names):
        return [LocalStep(path.parent.name, step, path)]
    if _NODE.match(path.name) and not any(n.endswith(".h5") for n in names):
        found = _steps_of(path)
    else:
        nodes = [path / n for n in names if _NODE.match(n) and (path / n).is_dir()]
        if not nodes:
            return None
        found = [s for node in nodes for s in _steps_of(node)]
    return sorted(found, key=lambda s: (s.step, s.node))


def read_file(path: Path, *, verify: bool) -> dict[str, Any]:
    """What one ``.ftk`` file holds (and whether its checksums hold, with ``verify``)."""
    out: dict[str, Any] = {"file": path.name, "bytes": 0, "tensors": [], "error": None}
    try:
        out["bytes"] = path.lstat().st_size
        with Shard.open(path) as shard:
            h = shard.header
            out.update(rank=h.get("rank"), step=h.get("step"), world=h.get("world"),
                       tensors=[{k: t[k] for k in ("path", "dtype", "shape", "nbytes")}
                                for t in shard.tensors])
            if verify:
                shard.verify()
    except CorruptCheckpointError as exc:
        out["error"] = exc.reason
    except OSError as exc:
        out["error"] = f"cannot read: {exc.strerror or exc}"
    return out


def _pick(steps: list[LocalStep], step: int | None) -> list[LocalStep]:
    if step is not None:
        return [s for s in steps if s.step == step]
    committed = [s for s in steps if s.committed]
    newest = committed[-1].step if committed else None
    return [s for s in committed if s.step == newest]


def cmd_inspect_local(args: argparse.Namespace, steps: list[LocalStep]) -> int:
    """``ftkit inspect`` of a node-local tree; 0 listed, 2 no such ``--step``."""
    chosen = _pick(steps, args.step)
    if args.step is not None and not chosen:
        print(f"ftkit inspect: error: no node-local step {args.step} in {args.path} "
              f"(steps: {', '.join(sorted({str(s.step) for s in steps})) or 'none'})")
        return 2
    doc = {"path": args.path, "level": "local", "steps": [
        {"node": s.node, "step": s.step, "dir": str(s.dir),
         "state": "committed" if s.committed else "tentative",
         "files": [read_file(p, verify=False) for p in s.files()]} for s in steps]}
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(f"node-local steps under {args.path} (as this host sees them)")
    for s, d in zip(steps, doc["steps"]):
        files = ", ".join(f"{f['file']} ({human(f['bytes'])}"
                          + (f"; {f['error']})" if f["error"] else ")") for f in d["files"])
        print(f"  {s.node}  step {s.step}  {d['state']:<9}  {files or 'no files'}")
    for s in chosen:
        for f in (read_file(p, verify=False) for p in s.files()):
            if f["file"].startswith("rank-") and not f["error"]:
                print(f"{s.node} step {s.step} {f['file']} (rank {f['rank']} of "
                      f"{f['world']}):")
                for t in f["tensors"]:
                    print(f"    {t['path']}  {t['dtype']}  {tuple(t['shape'])}  "
                          f"{human(t['nbytes'])}")
    return 0


def cmd_verify_local(args: argparse.Namespace, steps: list[LocalStep]) -> int:
    """``ftkit verify`` of a node-local tree; 0 intact, 1 a file is bad, 2 no such step."""
    if args.step is not None:
        chosen = [s for s in steps if s.step == args.step]
    elif step_number(Path(args.path).name) is not None:
        chosen = steps                           # the step PATH names, committed or not
    else:
        chosen = [s for s in steps if s.committed]
    if args.step is not None and not chosen:
        print(f"ftkit verify: error: no node-local step {args.step} in {args.path}")
        return 2
    results: list[dict[str, Any]] = [{"node": s.node, "step": s.step,
                                       "state": "committed" if s.committed else "tentative",
                                       "files": [read_file(p, verify=True) for p in s.files()]}
                                      for s in chosen]
    ok = all(f["error"] is None for r in results for f in r["files"])
    if args.json:
        print(json.dumps({"path": args.path, "level": "local", "ok": ok, "steps": results},
                         indent=1))
        return 0 if ok else 1
    for r in results:
        files = r["files"]
        bad = [f for f in files if f["error"]]
        size = sum(f["bytes"] for f in files)
        verdict = "intact" if not bad else f"{len(bad)} bad file(s)"
        print(f"{r['node']} step {r['step']} ({r['state']}): {len(files)} file(s), "
              f"{human(size)}: {verdict}")
        for f in bad:
            print(f"  {f['file']}: {f['error']}")
    if not results:
        print(f"ftkit verify: no committed node-local step in {args.path}")
    return 0 if ok else 1
