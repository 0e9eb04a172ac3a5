"""Private directories and files of the node-local tree (``FTKIT_LOCAL_DIR``).

``/dev/shm`` is world-writable: another user can create the default base directory
``/dev/shm/ftkit-$USER`` before ftkit does, open to everyone, as a directory of their own,
or as a symbolic link to one, and then read, redirect or hide the job's checkpoints. So:

* every directory ftkit creates or enters, from the base down to a step directory, is
  checked with ``lstat``: a real directory (not a symbolic link), owned by the effective uid,
  no group/other permission bits. A missing one is created 0700 and checked the same way
  (``mkdir``, then ``lstat`` of whatever is there: no race). Anything else is refused with
  :class:`~ftkit.errors.UnsafeLocalDirError`, which names the path, owner, mode and the fix;
* files are created only under a fresh name with ``O_CREAT | O_EXCL | O_NOFOLLOW``
  (:func:`create_new`, :func:`ftkit.fs.create_temp`), never through a name that
  already exists; files are read only when they are regular files (``lstat``,
  ``O_NOFOLLOW``), never through a symbolic link;
* removal never follows a symbolic link (:func:`remove_entry`).

The directories above the base are the user's choice and are not checked (``/dev/shm`` is
itself world-writable, and may legitimately be reached through a symbolic link).
"""
from __future__ import annotations

import logging
import os
import pwd
import shutil
import stat
from pathlib import Path

from ftkit.errors import UnsafeLocalDirError
from ftkit.fs import fsync_dir

log = logging.getLogger(__name__)

#: What to do about a base directory (``FTKIT_LOCAL_DIR``) that is refused.
BASE_HINT = ("remove it (or have its owner remove it) and ftkit creates it again with mode "
             "0700, `chmod 0700` it if it is yours and you trust what it holds, or set "
             "FTKIT_LOCAL_DIR to a directory of your own")
#: What to do about a refused directory below the base.
INNER_HINT = ("remove it (ftkit creates it again, mode 0700), or `chmod 0700` it if it is "
              "yours and you trust what it holds")


def owner(uid: int) -> str:
    """``name (uid N)`` of a user id (``?`` when the name is unknown)."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = "?"
    return f"{name} (uid {uid})"


def problem(path: Path, *, directory: bool) -> str | None:
    """Why ``path`` is not a private directory of this user (``directory``) or a regular file
    (otherwise); None when it is. Never follows a symbolic link; FileNotFoundError when
    ``path`` does not exist."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return f"is a symbolic link to {target} ({_owner_mode(st)})"
    if directory and not stat.S_ISDIR(st.st_mode):
        return f"is not a directory ({_owner_mode(st)})"
    if not directory:
        return None if stat.S_ISREG(st.st_mode) else f"is not a regular file ({_owner_mode(st)})"
    if st.st_uid != os.geteuid():
        return f"is owned by another user ({_owner_mode(st)}; ftkit runs as " \
               f"{owner(os.geteuid())})"
    if st.st_mode & 0o077:
        return f"is open to group/others ({_owner_mode(st)})"
    return None


def _owner_mode(st: os.stat_result) -> str:
    return f"owner {owner(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}"


def check_private_dir(path: Path, hint: str = INNER_HINT) -> None:
    """Raise UnsafeLocalDirError unless ``path`` is a real directory owned by this user
    with no group/other permission bits (``lstat``; FileNotFoundError when missing)."""
    why = problem(path, directory=True)
    if why is not None:
        raise UnsafeLocalDirError(
            f"{path} {why}. ftkit keeps node-local checkpoints only in directories private "
            f"to the user running it (real directories, not symbolic links, owned by that "
            f"user, mode 0700), so that no other user can redirect, hide or read them: "
            f"{hint}")


def create_missing_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents, mode 0700, durably (the parent of every
    directory created is fsynced). Existing entries are left as they are (not followed, not
    changed); one created meanwhile by another rank of the node is fine."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue                              # another rank of the node was faster
        fsync_dir(d.parent)                       # the new entry survives a crash


def ensure_private_dir(path: Path, hint: str = INNER_HINT) -> None:
    """Create ``path`` with mode 0700 when missing (its parent fsynced), then check whatever
    is there with :func:`check_private_dir`."""
    create_missing_dirs(path)
    check_private_dir(path, hint)


def ensure_private_tree(base: Path, path: Path) -> None:
    """Make ``path`` (at or below the base directory ``base``) usable: missing directories
    above ``base`` are created (0700, not checked when they exist), ``base`` and every
    directory from it down to ``path`` are created or checked private. Raises
    UnsafeLocalDirError (naming path, owner and mode) for one that is not."""
    rel = path.relative_to(base)
    create_missing_dirs(base.parent)
    ensure_private_dir(base, BASE_HINT)
    for part in rel.parts:
        base = base / part
        ensure_private_dir(base)


def create_new(path: Path) -> int:
    """Open a new file ``path`` (mode 0600) for writing; FileExistsError when any entry,
    a symbolic link included, already has that name (never followed)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)


def read_file(path: Path) -> bytes:
    """Contents of the regular file ``path``: OSError for a symbolic link (never followed)
    or UnsafeLocalDirError for anything else that is not a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeLocalDirError(f"{path} is not a regular file ({_owner_mode(st)})")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def remove_entry(path: Path) -> None:
    """Remove ``path`` without following symbolic links: a real directory with its
    contents, anything else (a planted link, a file) by itself. Errors inside a directory
    are ignored (like the retention it serves), others are logged."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):       # rmtree itself never follows a link inside
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)

