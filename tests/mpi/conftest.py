"""The MPI tier: collective tests that run on every rank of one mpiexec job.

Run as::

    mpiexec -n 4 --oversubscribe --bind-to none python -m mpi4py -m pytest tests/mpi -q \\
        -p no:cacheprovider

(``tests/test_mpi_tier.py`` does exactly that from a plain ``pytest tests``.)

Rules this conftest enforces or provides:

- Outside mpiexec (a plain, single-process pytest) the whole directory is ignored at
  collection; MPI is not even initialised unless a launcher's variables are present.
- Every test gets a per-test timeout (``MPI_TEST_TIMEOUT``, default 120 s, via pytest-timeout's
  timer hooks); on expiry the rank prints its stacks and calls ``COMM_WORLD.Abort`` so the
  job dies instead of hanging.
- After every test the ranks exchange their outcome: a test that failed on some other rank
  fails (at teardown) on every rank, with that rank's message, so rank 0's report shows it.
- ``ftkit_env`` gives each test fresh ``FTKIT_*`` directories under one temporary directory
  that is the same on all ranks (rank 0 creates it and broadcasts the path), 2 virtual nodes
  (``FTKIT_RANKS_PER_NODE=2``), ``FTKIT_LEVELS=local:1`` and no other ``FTKIT_*`` variable.
"""
from __future__ import annotations

import dataclasses
import faulthandler
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
WORLD_SIZE_NEEDED = 4
_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
_CALL_REPORT = pytest.StashKey[Any]()
_TIMER = pytest.StashKey[threading.Timer]()
_size_cache: list[int] = []


def _world_size() -> int:
    """Size of COMM_WORLD, without initialising MPI when no launcher started us."""
    if not _size_cache:
        if not any(v in os.environ for v in _LAUNCHER_VARS) and "mpi4py.MPI" not in sys.modules:
            _size_cache.append(1)
        else:
            from mpi4py import MPI
            _size_cache.append(MPI.COMM_WORLD.Get_size())
    return _size_cache[0]


def _in_tier(item: pytest.Item) -> bool:
    return HERE in Path(str(item.path)).resolve().parents


# --------------------------------------------------------------------- collection
def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A single-process pytest skips the MPI tier (tests/test_mpi_tier.py launches it)."""
    if _world_size() < 2:
        return True
    return None


def pytest_report_header(config: pytest.Config) -> str | None:
    if _world_size() < 2:
        return ("tests/mpi: not under mpiexec, so the MPI tier is ignored here; it runs via "
                "tests/test_mpi_tier.py or `mpiexec -n 4 python -m mpi4py -m pytest tests/mpi`")
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if _in_tier(item)]
    if not mine:
        return
    if _world_size() != WORLD_SIZE_NEEDED:
        raise pytest.UsageError(f"tests/mpi needs exactly {WORLD_SIZE_NEEDED} MPI ranks, this "
                                f"job has {_world_size()}")
    timeout = float(os.environ.get("MPI_TEST_TIMEOUT", "120"))
    for item in mine:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(timeout))


# ------------------------------------------------------------ timeout = abort world
@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool | None:
    """Replace pytest-timeout's action: dump stacks, then abort the whole MPI job."""
    if _world_size() < 2 or not _in_tier(item):
        return None
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.Get_rank()

    def expire() -> None:
        capman = item.config.pluginmanager.getplugin("capturemanager")
        try:                            # write to the real stderr, not the capture file
            if capman is not None:
                capman.suspend_global_capture(in_=True)
                out, err = capman.read_global_capture()
                sys.stderr.write(f"[rank {rank}] captured stdout:\n{out[-4000:]}\n"
                                 f"[rank {rank}] captured stderr:\n{err[-4000:]}\n")
        except Exception as exc:  # noqa: BLE001 - never let this stop the abort
            sys.stderr.write(f"[rank {rank}] (could not read the captured output: {exc})\n")
        sys.stderr.write(f"\n[rank {rank}] TIMEOUT: {item.nodeid} ran past {settings.timeout:g}"
                         f" s; aborting the MPI job\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(124)

    timer = threading.Timer(settings.timeout, expire)
    timer.name = f"mpi-timeout {item.nodeid}"
    timer.daemon = True
    item.stash[_TIMER] = timer
    timer.start()
    return True


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    timer = item.stash.get(_TIMER, None)
    if timer is None:
        return None
    timer.cancel()
    del item.stash[_TIMER]
    return True


# ------------------------------------------------ one rank's failure seen everywhere
@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[_CALL_REPORT] = report
    return report


@pytest.fixture(autouse=True)
def _mpi_same_outcome(request: pytest.FixtureRequest) -> Iterator[None]:
    """After the test, every rank learns which ranks failed; a failure elsewhere fails here."""
    yield
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    report = request.node.stash.get(_CALL_REPORT, None)
    failed = bool(report is not None and report.failed)
    text = report.longreprtext[-3000:] if failed else ""
    outcomes = comm.allgather((failed, text))
    others = {r: t for r, (f, t) in enumerate(outcomes) if f and r != comm.Get_rank()}
    if others:
        pytest.fail("the test failed on rank(s) " + ", ".join(map(str, others)) + ":\n"
                    + "\n".join(f"----- rank {r} -----\n{t}" for r, t in others.items()),
                    pytrace=False)


# ----------------------------------------------------------------- FTKIT_* per test
@dataclasses.dataclass(frozen=True)
class FtkitEnv:
    """Paths of one test's ftkit job (identical on every rank)."""

    root: Path
    local_dir: Path
    pfs_dir: Path
    job: str

    def node_dir(self, node: int) -> Path:
        return self.local_dir / self.job / f"node-{node}"

    def step_dir(self, node: int, step: int) -> Path:
        return self.node_dir(node) / f"step-{step}"

    @property
    def events_path(self) -> Path:
        return self.pfs_dir / self.job / "events.jsonl"


@pytest.fixture
def ftkit_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[FtkitEnv]:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    root = None
    if comm.Get_rank() == 0:
        root = tempfile.mkdtemp(prefix="ftkit-mpi-")
        (Path(root) / "ftkit.toml").write_text("# empty: defaults < env < keywords\n")
    root = comm.bcast(root, root=0)
    env = FtkitEnv(Path(root), Path(root) / "local", Path(root) / "pfs", "mpitier")
    for key in list(os.environ):
        if key.startswith("FTKIT_"):
            monkeypatch.delenv(key)
    values = {
        "FTKIT_JOB": env.job,
        "FTKIT_LOCAL_DIR": str(env.local_dir),
        "FTKIT_PFS_DIR": str(env.pfs_dir),
        "FTKIT_LEVELS": "local:1",
        "FTKIT_RANKS_PER_NODE": "2",
        "FTKIT_TIMEOUT": "60",
        "FTKIT_CONFIG": str(Path(root) / "ftkit.toml"),   # never read ./ftkit.toml
    }
    for key, val in values.items():
        monkeypatch.setenv(key, val)
    try:
        yield env
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def torch_group() -> Iterator[None]:
    """torch's default process group over the 4 ranks (gloo), for one test module."""
    pytest.importorskip("torch")
    import torch.distributed as dist
    from mpi4py import MPI

    import ftkit
    ftkit.init_torch_distributed(MPI.COMM_WORLD, backend="gloo", timeout_s=60)
    try:
        yield
    finally:
        dist.destroy_process_group()
