"""Shared plumbing of the MPI benchmarks: relaunch under the venv's mpiexec, common options."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self


def parser(doc: str) -> argparse.ArgumentParser:
    """Options every MPI benchmark takes (``--child`` marks the relaunched ranks)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return ap


def run(script: str, args: argparse.Namespace, child: Callable[[argparse.Namespace], None]
        ) -> None:
    """In a rank: run ``child``. Otherwise relaunch ``script`` on ``args.ranks`` ranks with
    the venv's mpiexec (root and oversubscription flags set) and exit with its status."""
    if args.child:
        child(args)
        return
    sys.exit(launch(script, args.ranks, [*sys.argv[1:], "--child"]))


def launch(script: str, ranks: int, argv: list[str], timeout: float = 1800) -> int:
    """Run ``script`` on ``ranks`` ranks with the venv's mpiexec (root and oversubscription
    flags set, inherited ``FTKIT_*`` variables dropped) and return its exit status; for
    benchmarks that launch several worlds in one run."""
    mpiexec = Path(sys.executable).with_name("mpiexec")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTKIT_")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [str(mpiexec), "--oversubscribe", "--bind-to", "none", "-n", str(ranks),
           sys.executable, "-m", "mpi4py", script, *argv]
    return subprocess.call(cmd, env=env, timeout=timeout)


def timed(comm: Any, fn: Callable[[], object]) -> float:
    """Seconds from a barrier before ``fn`` to a barrier after it (same on every rank)."""
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    comm.Barrier()
    return time.perf_counter() - t0


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min and max of per-round figures, and the rounds."""
    ordered = sorted(values)
    return {"median": ordered[len(ordered) // 2], "min": ordered[0], "max": ordered[-1],
            "rounds": [round(v, 4) for v in values]}


def best_of(comm: Any, fn: Callable[[], object], repeat: int) -> float:
    """The fastest of ``repeat`` :func:`timed` runs of ``fn``."""
    return min(timed(comm, fn) for _ in range(max(1, repeat)))


def costs(comm: Any, fn: Callable[[], object], state_bytes: int) -> dict[str, Any]:
    """What one call of ``fn`` costs a rank, the most any rank paid: ``passes`` over the
    state's ``state_bytes`` bytes by kind (counted by ftkit's code paths, ``ftkit.passes``),
    ``cpu_s`` (CPU seconds of the process, every thread, waits inside ``fn`` included) and
    ``peak_extra_mib`` (peak resident memory during ``fn`` above the resident memory before
    it; Linux ``VmHWM``, reset first: it counts mapped node-local files too) and
    ``peak_private_mib`` (peak private resident memory above the one before, sampled every
    millisecond: memory no file holds). Every rank calls."""
    from ftkit import passes
    comm.Barrier()
    reset_peak()
    rss, before, cpu = status_kib("VmRSS"), passes.snapshot(), time.process_time()
    private = private_bytes()
    with PrivatePeak() as sampled:
        fn()
    cpu = time.process_time() - cpu
    moved = passes.passes(passes.since(before), state_bytes)
    peak = max(0, status_kib("VmHWM") - rss)
    extra = max(0, sampled.peak - private)
    every = comm.allgather((moved, cpu, peak, extra))
    return {"passes": {k: round(max(m[k] for m, *_ in every), 3) for k in moved},
            "cpu_s": round(max(e[1] for e in every), 4),
            "peak_extra_mib": round(max(e[2] for e in every) / 1024, 1),
            "peak_private_mib": round(max(e[3] for e in every) / 2 ** 20, 1)}


PAGE = os.sysconf("SC_PAGE_SIZE")


class PrivatePeak:
    """Samples this process's private resident memory (statm resident - shared) every
    millisecond on a thread while in use; ``peak`` in bytes."""

    def __init__(self) -> None:
        self.peak = private_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, private_bytes())

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, private_bytes())


def private_bytes() -> int:
    """Resident bytes of this process that no file backs (statm resident - shared)."""
    fields = Path("/proc/self/statm").read_text().split()
    return (int(fields[1]) - int(fields[2])) * PAGE


def reset_peak() -> None:
    """Reset this process's peak resident memory (``VmHWM``) to the current one."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def status_kib(key: str) -> int:
    """A ``/proc/self/status`` figure in KiB (0 where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


@contextlib.contextmanager
def scratch(comm: Any, *parents: str) -> Iterator[list[Path]]:
    """One private directory under each of ``parents``, shared by all ranks (rank 0 creates
    them); removed after a barrier on success, by every rank without one on error."""
    dirs = [Path(p) for p in comm.bcast(
        [tempfile.mkdtemp(prefix="ftkit-bench-", dir=d) for d in parents]
        if comm.rank == 0 else None)]
    try:
        yield dirs
    except BaseException:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
        raise
    comm.Barrier()
    if comm.rank == 0:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


def machine() -> dict[str, Any]:
    """Cores, memory and versions of this machine (the MPI library's when MPI is loaded)."""
    import mpi4py
    import numpy
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    info: dict[str, Any] = {"cores": os.cpu_count(), "memory_gib": round(mem, 1),
                            "python": platform.python_version(), "numpy": numpy.__version__,
                            "mpi4py": mpi4py.__version__, "platform": platform.platform()}
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        info["mpi"] = mpi.Get_library_version().splitlines()[0].strip("\x00 ")
    for name in ("torch", "h5py"):
        if name in sys.modules:
            info[name] = sys.modules[name].__version__
    return info


def write_report(out: str, name: str, report: dict[str, Any]) -> Path:
    """Write ``report`` as ``<out>/<name>.json`` (creating ``out``); returns the path."""
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path
