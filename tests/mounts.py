"""Real small file systems for end-to-end tests: a tmpfs of a given size mounted where a job
keeps its PFS directory (root only; the tests skip with the reason elsewhere), filled with a
ballast file, or hidden under an empty bind mount (a directory that vanished)."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _mount(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["mount", *args], check=False, capture_output=True, text=True,
                          timeout=30)


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True, timeout=30)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (e.g. ``"2m"``) at ``path`` (created) for the block;
    pytest.skip when this process may not mount file systems."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    path.mkdir(parents=True, exist_ok=True)
    res = _mount("-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path))
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield path
    finally:
        _umount(path)


def fill(path: Path, name: str = "ballast", *, leave: int = 0) -> Path:
    """Write zeros into ``path/name`` until the file system is full, then give ``leave``
    bytes back (rounded to pages by the file system); returns the file."""
    ballast = path / name
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for chunk in (b"\0" * (1 << 20), b"\0" * 4096):
            with contextlib.suppress(OSError):
                while os.write(fd, chunk) == len(chunk):
                    pass
        if leave:
            os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
    finally:
        os.close(fd)
    return ballast


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def hidden(path: Path, empty: Path) -> Iterator[None]:
    """Bind-mount the empty directory ``empty`` over ``path`` for the block: what ``path``
    held vanishes and comes back afterwards."""
    empty.mkdir(parents=True, exist_ok=True)
    res = _mount("--bind", str(empty), str(path))
    if res.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {res.stderr.strip()}")
    try:
        yield
    finally:
        _umount(path)
