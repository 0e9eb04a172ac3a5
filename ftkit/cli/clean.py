"""``ftkit clean JOB``: remove a job's checkpoints on this host, refusing what ftkit did not
create and a job that is running."""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftkit.cli.args import error
from ftkit.cli.fmt import human, tree_size
from ftkit.config import Config
from ftkit.errors import ConfigError
from ftkit.jobdir import paths


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``ftkit clean JOB [--dry-run] [--force]``."""
    p = sub.add_parser(
        "clean", help="delete a job's checkpoints on this host (start over for good)",
        description="Remove the checkpoint data of JOB that this host can see: "
                    "$FTKIT_PFS_DIR/JOB (PFS steps, event log) and $FTKIT_LOCAL_DIR/JOB (the "
                    "node-local directories of every (virtual) node of this machine; under "
                    "Slurm also $FTKIT_LOCAL_DIR/$SLURMD_NODENAME/JOB). Node-local data lives "
                    "on every node: on a cluster run it on every node, once per node, e.g. "
                    "'srun --ntasks-per-node=1 ftkit clean JOB'. Run it only when the job is "
                    "not running. Prints each directory removed with its size. Refuses "
                    "directories holding entries ftkit does not create (listed) unless --force. "
                    "Exit 0: removed, or nothing was there; 1: refused, nothing removed; "
                    "2: usage error.")
    p.add_argument("job", metavar="JOB", help="the job id (FTKIT_JOB / SLURM_JOB_ID)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed")
    p.add_argument("--force", action="store_true",
                   help="remove the job directories even when they hold other entries")
    p.set_defaults(func=_cmd_clean)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What ftkit creates in a directory: directory names, file names, and what may be in
    those directories (None: not looked into)."""

    dirs: str
    files: str = ""
    inner: _Layout | None = None

    def odd(self, root: Path) -> list[str]:
        """Entries under ``root`` that ftkit does not create there."""
        found: list[str] = []
        for entry in sorted(os.scandir(root), key=lambda e: e.name):
            if entry.is_dir(follow_symlinks=False) and re.fullmatch(self.dirs, entry.name):
                if self.inner is not None:
                    found += [f"{entry.name}/{name}" for name in self.inner.odd(Path(entry.path))]
            elif not (entry.is_file(follow_symlinks=False) and self.files
                      and re.fullmatch(self.files, entry.name)):
                found.append(entry.name + ("/" if entry.is_dir(follow_symlinks=False) else ""))
        return found

    def __or__(self, other: _Layout) -> _Layout:
        """Both layouts in one directory (PFS and node-local roots that coincide)."""
        files = "|".join(f for f in (self.files, other.files) if f)
        return _Layout(f"{self.dirs}|{other.dirs}", files, None)


#: $FTKIT_PFS_DIR/<job> and $FTKIT_LOCAL_DIR/<job> (ftkit.jobdir.paths)
_PFS_LAYOUT = _Layout(paths.PFS_DIRS, paths.PFS_FILES, None)
_LOCAL_LAYOUT = _Layout(paths.LOCAL_DIRS, "", _Layout(paths.NODE_DIRS, paths.NODE_FILES, None))


def _clean_targets(cfg: Config) -> dict[Path, _Layout]:
    """Directories of ``cfg.job`` that this host sees, and what ftkit puts in each."""
    targets = {Path(os.path.abspath(cfg.job_pfs_dir)): _PFS_LAYOUT}
    for host in dict.fromkeys((None, os.environ.get("SLURMD_NODENAME") or None)):
        local = Path(os.path.abspath(cfg.node_dir(0, host).parent))
        targets[local] = targets[local] | _LOCAL_LAYOUT if local in targets else _LOCAL_LAYOUT
    return targets


def _unsafe_local(cfg: Config, found: list[Path]) -> list[Path]:
    """The node-local job directories in ``found`` that are not this user's private
    directories (below a private ``FTKIT_LOCAL_DIR``): on a shared ``/dev/shm`` they may be
    another user's; each refusal is printed."""
    from ftkit.storage.private import problem
    base = Path(os.path.abspath(cfg.local_dir))
    unsafe = []
    for path in found:
        if base not in path.parents:
            continue
        why = problem(base, directory=True) or problem(path, directory=True)
        if why is not None:
            print(f"ftkit clean: refused: {path} (in {base}): {why}; remove it yourself if it "
                  "is yours", file=sys.stderr)
            unsafe.append(path)
    return unsafe


def _running(job: str, found: list[Path]) -> list[Path]:
    """The directories in ``found`` whose job lock (``LOCK``, or ``node-*/LOCK`` below a
    node-local job directory) is held now: the job is running; each refusal is printed."""
    from ftkit.jobdir.lock import LOCK_FILE, describe, held_by
    busy = []
    for path in found:
        for lock in [path / LOCK_FILE, *sorted(path.glob(f"node-*/{LOCK_FILE}"))]:
            holder = held_by(lock)
            if holder is not None:
                print(f"ftkit clean: refused: job {job} is running: {describe(holder)} holds "
                      f"{lock}; stop it first", file=sys.stderr)
                busy.append(path)
                break
    return busy


def _ignore_vanished(_func: Callable[..., object], _path: str, exc_info: Any) -> None:
    """rmtree error handler: another node's ``ftkit clean`` may remove the same PFS files."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def _cmd_clean(args: argparse.Namespace) -> int:
    """Body of ``ftkit clean`` (plain file operations; no MPI, no torch)."""
    job = args.job
    if not job or "/" in job or ".." in job or job == "." or "\0" in job:
        return error("clean", ValueError(f"JOB {job!r} is not a job id (a plain name: no "
                                          "'/', no '..', not empty); nothing removed"))
    try:
        cfg = Config.load(job=job)
        targets = _clean_targets(cfg)
    except ConfigError as exc:
        return error("clean", exc)
    found = [p for p in targets if os.path.lexists(p)]
    not_dirs = [p for p in found if p.is_symlink() or not p.is_dir()]
    for path in not_dirs:
        print(f"ftkit clean: refused: {path} is not a directory ftkit created (a file or a "
              "symbolic link); remove it yourself", file=sys.stderr)
    not_dirs += _unsafe_local(cfg, [p for p in found if p not in not_dirs])
    not_dirs += _running(cfg.job, [p for p in found if p not in not_dirs])
    odd = {p: targets[p].odd(p) for p in found if p not in not_dirs}
    for path, names in odd.items():
        if names and not args.force:
            print(f"ftkit clean: refused: {path} holds entries ftkit does not create: "
                  f"{', '.join(names)}", file=sys.stderr)
    if not_dirs or (any(odd.values()) and not args.force):
        print("ftkit clean: nothing removed" + ("" if not_dirs else
                                                "; --force removes those entries too"),
              file=sys.stderr, flush=True)
        return 1
    if not found:
        print(f"ftkit clean: nothing to remove for job {job} on {socket.gethostname()}: "
              f"{' and '.join(str(p) for p in targets)} do not exist", flush=True)
        return 0
    for path in found:
        size = human(tree_size(path))
        if args.dry_run:
            print(f"ftkit clean: would remove {path} ({size})", flush=True)
            continue
        try:
            shutil.rmtree(path, onerror=_ignore_vanished)
        except OSError as exc:
            print(f"ftkit clean: error: cannot remove {path}: {exc}", file=sys.stderr,
                  flush=True)
            return 1
        print(f"ftkit clean: removed {path} ({size})", flush=True)
    return 0
