"""Files written whole or not at all, renames made durable, files opened without following
links: the one home of these for every writer and reader of ftkit.

* :func:`write_atomic` / :func:`write_text_atomic` / :func:`write_record` (JSON) — a private temp file in the same
  directory (:func:`create_temp`), fsync, rename over the target (:func:`rename_into_place`),
  fsync of the directory: a reader sees the old file or the new one, never a part;
* :func:`fsync_dir` — make a rename or unlink inside a directory durable;
* :func:`open_regular` — a read-only descriptor of a regular file, never through a symbolic
  link, never blocking on a FIFO.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ftkit import passes
from ftkit.errors import CorruptCheckpointError


def write_atomic(path: Path, pieces: Iterable[Any], *, mode: int = 0o600) -> int:
    """Write ``pieces`` (buffers) to ``path`` atomically: a new private temp file in the
    same directory (:func:`create_temp`), fsync, rename, fsync of the directory; the file
    gets ``mode``. Returns the bytes written; on error the temp file is removed and ``path``
    is untouched. The rename replaces whatever ``path`` names, a symbolic link included,
    and never writes through it."""
    fd, tmp = create_temp(path)
    try:
        size = sum(write_all(fd, piece) for piece in pieces)
        if mode != 0o600:
            os.fchmod(fd, mode)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    rename_into_place(tmp, path)
    return size


def rename_into_place(tmp: Path, path: Path) -> None:
    """Rename the complete temp file ``tmp`` over ``path`` and fsync the directory; on
    error ``tmp`` is removed and ``path`` is untouched."""
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def create_temp(path: Path) -> tuple[int, Path]:
    """Create the temp file of an atomic write of ``path``: a new name
    ``.<name>.<random>.tmp`` in the same directory, mode 0600, opened with
    ``O_CREAT | O_EXCL | O_NOFOLLOW`` (``tempfile.mkstemp``), so an entry that already has
    the name (a leftover, a planted symbolic link) is never opened or written through.
    Returns the open descriptor and the temp path."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    return fd, Path(name)


def write_all(fd: int, data: Any) -> int:
    """Write all of buffer ``data`` to ``fd`` (short writes continued); its length."""
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])
    passes.count("write", done)
    return done


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str, *, mode: int = 0o600) -> None:
    """:func:`write_atomic` of ``text`` (UTF-8)."""
    write_atomic(path, [text.encode()], mode=mode)


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Durably write a small JSON record (:func:`write_atomic`)."""
    write_atomic(path, [json.dumps(record).encode()])


def open_regular(path: Path, *, rank: int | None = None, step: int | None = None,
                 level: str = "local") -> int:
    """A read-only descriptor of the regular file ``path``: opened with ``O_NOFOLLOW |
    O_NONBLOCK`` (a symbolic link is never followed, a FIFO never blocks) and checked with
    ``fstat``. Raises CorruptCheckpointError naming the file (and ``rank``, ``step``,
    ``level``) for a link or anything else that is not a regular file; OSError otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise CorruptCheckpointError(
                str(path), f"is a symbolic link to {_link_target(path)}; ftkit does not "
                f"follow it", rank=rank, step=step, level=level) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptCheckpointError(str(path), "is not a regular file", rank=rank,
                                         step=step, level=level)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _link_target(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return "?"
