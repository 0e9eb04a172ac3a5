"""Find the rank processes of a running MPI job from outside (tests and benchmarks that
kill ranks the way an operator or the OOM killer would; Linux ``/proc``)."""
from __future__ import annotations

import os
from pathlib import Path

from ftkit.jobdir.lock import process_state


def rank_processes(cwd: Path, world_ranks: list[int]) -> dict[int, int]:
    """``{world rank: pid}`` of the processes that run in directory ``cwd`` (a job started
    there) and whose ``OMPI_COMM_WORLD_RANK`` is one of ``world_ranks``: each rank's own
    process, not the processes it started (data loader workers inherit its environment).
    Local, read-only."""
    found: dict[int, dict[int, int]] = {}         # rank -> {pid: parent pid}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/cwd") != str(cwd):
                continue
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        for var in env:
            if var.startswith(b"OMPI_COMM_WORLD_RANK="):
                rank = int(var.split(b"=", 1)[1])
                if rank in world_ranks:
                    found.setdefault(rank, {})[int(entry)] = parent
    out = {}
    for rank, procs in found.items():
        mains = [pid for pid, parent in procs.items() if parent not in procs]
        if len(mains) == 1:
            out[rank] = mains[0]
    return out


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie nobody reaped yet counts as ended).
    Local, read-only."""
    return process_state(pid) in (None, "Z", "X")
