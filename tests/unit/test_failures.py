"""ftkit.launch.failures: which ranks took an attempt down, and how.

The launcher texts are what Open MPI 5's ``prterun`` and Slurm's ``srun`` print (the Open MPI
ones captured from real runs on this machine: a rank SIGKILLed, one calling ``MPI_Abort(5)``,
one exiting with status 3, one segfaulting); the tee runs a real pipe; the records are written
by :func:`ftkit.jobdir.fatal.record_death` as the abort hooks and the Checkpointer write them.
"""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ftkit.comm.dist import lost_peer
from ftkit.errors import ConfigError
from ftkit.jobdir.fatal import FATAL_DIR_ENV, read_fatal, read_records, record_death
from ftkit.launch.failures import (
    LauncherScan,
    StderrTee,
    explain,
    lost_daemons_reason,
    scan,
    summary,
)
from ftkit.launch.outcome import attempt_line, judge

OMPI_KILLED = """\
--------------------------------------------------------------------------
prterun noticed that process rank 1 with PID 15921 on node vm exited on
signal 9 (Killed).
--------------------------------------------------------------------------
"""
OMPI_ABORT = """\
--------------------------------------------------------------------------
MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD
  Proc: [[18037,1],1]
  Errorcode: 5

NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.
--------------------------------------------------------------------------
"""
OMPI_EXIT = """\
--------------------------------------------------------------------------
prterun detected that one or more processes exited with non-zero status,
thus causing the job to be terminated. The first process to do so was:

   Process name: [prterun-vm-16106@1,2]
   Exit code:    3
--------------------------------------------------------------------------
"""
OMPI4_EXIT = OMPI_EXIT.replace("[prterun-vm-16106@1,2]", "[[18037,1],2]")
SRUN = """\
srun: error: n3: task 1: Killed
srun: error: n4: tasks 4-5,7: Exited with exit code 1
srun: Terminating StepId=12.0
"""


def _mpirun(code: str, fatal_dir: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -c code`` on two real ranks under mpiexec with ``FTKIT_FATAL_DIR`` set; the
    whole process group is killed when it outlives ``timeout`` (a hang fails the test)."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.is_file():
        pytest.skip(f"no mpiexec next to {sys.executable} (the test extras install it)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD_", "PMIX_"))}
    env.pop("FTKIT_LOG_LEVEL", None)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               **{FATAL_DIR_ENV: str(fatal_dir)})
    argv = [str(mpiexec), "-n", "2", "--oversubscribe", "--bind-to", "none",
            sys.executable, "-c", code]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the job hung for {timeout} s")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _feed(text: str) -> dict[int, str]:
    s = LauncherScan()
    for line in text.splitlines(keepends=True):
        s.feed(line)
    return s.found


@pytest.mark.parametrize("text,want", [
    (OMPI_KILLED, {1: "killed by SIGKILL on node vm"}),
    (OMPI_ABORT, {1: "called MPI_Abort (errorcode 5)"}),
    (OMPI_EXIT, {2: "exited with status 3"}),
    (OMPI4_EXIT, {2: "exited with status 3"}),
    (SRUN, {1: "killed on node n3", 4: "exited with exit code 1 on node n4",
            5: "exited with exit code 1 on node n4", 7: "exited with exit code 1 on node n4"}),
    ("rank 1 printed this line\nTraceback (most recent call last):\n", {}),
])
def test_launcher_reports_are_found_across_wrapped_lines(text: str, want: dict[int, str]
                                                         ) -> None:
    assert _feed(text) == want


OMPI_LOST_DAEMON = """\
--------------------------------------------------------------------------
PRTE has lost communication with a remote daemon.

  HNP daemon   : [prterun-vm-16534@0,0] on node vm
  Remote daemon: [prterun-vm-16534@0,3] on node n3

This is usually due to either a failure of the TCP network
connection to the node, or possibly an internal failure of
the daemon itself. We cannot recover from this failure, and
therefore will terminate the job.
--------------------------------------------------------------------------
"""


def test_a_lost_daemon_names_its_node_and_the_attempt_says_why() -> None:
    s = LauncherScan()
    for line in (OMPI_LOST_DAEMON * 2).splitlines(keepends=True):
        s.feed(line)
    assert s.lost_nodes == ["n3"] and s.found == {}
    why = lost_daemons_reason(s.lost_nodes)
    assert "lost its daemon on node n3" in why and "in-job recovery" in why
    res = judge(0, 0, False, 37.8, 0.0, lost=why)       # PRRTE exits 0 then
    assert not res.ok and res.reason.endswith(f"Checkpointer.close() on every rank: {why}")
    assert lost_daemons_reason([]) == ""
    assert judge(0, 0, True, 1.0, 0.0, lost=why).reason == "succeeded"


def test_segfault_and_unknown_signal_numbers() -> None:
    assert scan("prterun noticed that process rank 0 with PID 1 on node a exited on "
                "signal 11 (Segmentation fault).") == {0: "killed by SIGSEGV on node a"}
    assert scan("mpiexec noticed that process rank 3 with PID 1 on node a exited on "
                "signal 99 (?).") == {3: "killed by signal 99 on node a"}


def test_first_report_of_a_rank_is_kept() -> None:
    assert _feed(OMPI_KILLED + OMPI_KILLED.replace("signal 9 (Killed)",
                                                   "signal 15 (Terminated)"))[1] \
        == "killed by SIGKILL on node vm"


USER_BOX = "-" * 74 + "\nepoch 3 | loss 0.25\n" + "-" * 74 + "\n"


@pytest.mark.parametrize("condense", [True, False])
def test_tee_copies_everything_and_scans_it(condense: bool) -> None:
    """A real pipe from a child that writes the launcher's report between its own lines (one
    framed like Open MPI's), then a long line without a newline: the sink gets every byte
    but the report it condensed, in order; the scan finds the failed rank either way."""
    blob = "x" * 100_000
    text = "before\n" + OMPI_KILLED + USER_BOX + "é\n" + blob
    code = f"import sys; sys.stderr.write({text!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    assert proc.stderr is not None
    sink = io.StringIO()
    tee = StderrTee(proc.stderr, sink, condense=condense)
    tee.start()
    assert proc.wait(timeout=30) == 0
    assert tee.found(wait=30) == {1: "killed by SIGKILL on node vm"}
    assert not tee.is_alive()
    want = text if not condense else "before\n" + USER_BOX + "é\n" + blob
    assert sink.getvalue() == want


def test_records_say_more_than_the_abort_they_led_to(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FATAL_DIR_ENV, str(tmp_path))
    record_death(2, aborted="timeout in phase 'vote' of step 3: a peer rank is dead or hung")
    record_death(1, RuntimeError("CUDA error: an illegal memory access\nsecond line"))
    record_death(1, RuntimeError("a later one is not kept"))
    records = read_records(tmp_path)
    assert [r["rank"] for r in records] == [2, 1]            # oldest first
    assert all(r["recurs"] is False for r in records)
    assert read_fatal(tmp_path) is None                       # retried: nothing recurs
    failed = explain({0: "killed by SIGKILL on node a", 1: "called MPI_Abort (errorcode 1)",
                      3: "exited with status 1"}, records)
    assert list(failed.items()) == [
        (0, "killed by SIGKILL on node a"),
        (2, ("gave up on its peers: timeout in phase 'vote' of step 3: a peer rank is dead "
             "or hung")),
        (1, "raised RuntimeError: CUDA error: an illegal memory access"),
        (3, "exited with status 1")]


def test_a_recurring_uncaught_error_still_stops_the_loop(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setenv(FATAL_DIR_ENV, str(tmp_path))
    record_death(0, ValueError("not ftkit's"))
    record_death(3, ConfigError("FTKIT_LEVELS: unknown level 'bogus'"))
    fatal = read_fatal(tmp_path)
    assert fatal is not None and (fatal["rank"], fatal["kind"]) == (3, "ConfigError")


def test_summary_names_three_ranks_and_counts_the_rest() -> None:
    failed = {r: "killed by SIGKILL on node a" for r in range(5)}
    assert summary(failed) == ("rank 0 killed by SIGKILL on node a; rank 1 killed by SIGKILL "
                               "on node a; rank 2 killed by SIGKILL on node a; 2 more")
    long = summary({0: "raised RuntimeError: " + "y" * 500})
    assert len(long) < 200 and long.endswith("[...]")
    assert summary({}) == ""


def test_attempt_line_names_the_failed_rank() -> None:
    res = judge(0, 137, False, 4.25, 0.0, failed={1: "killed by SIGKILL on node vm"})
    assert res.failed == {1: "killed by SIGKILL on node vm"}
    assert attempt_line(res, 3) == ("ftkit run: attempt 0: failed (exit 137: rank 1 killed "
                                    "by SIGKILL on node vm) after 4.2 s; relaunching "
                                    "(restart 1 of 3)")
    ok = judge(1, 0, True, 1.0, 0.0, failed={1: "stale"})
    assert ok.ok and ok.failed == {} and "rank" not in attempt_line(ok, 3)


@pytest.mark.parametrize("raised,recurring", [
    ("KeyError('weights.17')", False),
    ("ConfigError('FTKIT_LEVELS: unknown level bogus')", True)])
def test_an_abort_hook_records_the_exception_for_ftkit_run(tmp_path: Path, raised: str,
                                                           recurring: bool) -> None:
    """Two real ranks under mpiexec: rank 1 raises after the hooks are installed. The
    record names rank 1 and the exception (it stops the relaunch loop only when the error
    would recur); an error that would recur is one line on stderr, the others a traceback."""
    code = ("from ftkit.comm.dist import install_abort_hooks\n"
            "from ftkit.errors import ConfigError\n"
            "from mpi4py import MPI\n"
            "install_abort_hooks()\n"
            "if MPI.COMM_WORLD.Get_rank() == 1:\n"
            f"    raise {raised}\n"
            "MPI.COMM_WORLD.Barrier()\n")
    res = _mpirun(code, tmp_path, timeout=120)
    assert res.returncode != 0
    [record] = read_records(tmp_path)
    kind = raised.split("(")[0]
    assert (record["rank"], record["kind"], record["recurs"]) == (1, kind, recurring)
    assert (read_fatal(tmp_path) is not None) == recurring
    assert explain(_feed(res.stderr), [record])[1].startswith(f"raised {kind}: ")
    if recurring:
        assert "ftkit: rank 1: ConfigError: FTKIT_LEVELS: unknown level bogus\n" in res.stderr
        assert "Traceback" not in res.stderr, res.stderr
    else:
        assert "Traceback" in res.stderr and "KeyError: 'weights.17'" in res.stderr


def test_a_rank_that_lost_a_peer_lets_the_launcher_name_the_dead_one(tmp_path: Path
                                                                     ) -> None:
    """Two real ranks under mpiexec: rank 1 fails at once with what gloo says when a peer
    vanished, rank 0 is killed by SIGKILL a moment later. Rank 1 waits
    ``LOST_PEER_GRACE`` before it aborts, so the launcher reports rank 0's death first: the
    attempt's exit status is 137 and the explanation names rank 0, killed, before rank 1.
    Before: rank 1's abort came first and the attempt line blamed rank 1 (exit 1)."""
    code = ("import os, signal, time\n"
            "from ftkit.comm.dist import install_abort_hooks\n"
            "from mpi4py import MPI\n"
            "install_abort_hooks()\n"
            "MPI.COMM_WORLD.Barrier()\n"
            "if MPI.COMM_WORLD.Get_rank() == 1:\n"
            "    raise RuntimeError('[gloo/transport/tcp/pair.cc:537] Read error "
            "[127.0.0.1]:6016: Connection reset by peer')\n"
            "time.sleep(0.3)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    res = _mpirun(code, tmp_path, timeout=120)
    assert res.returncode == 137, (res.returncode, res.stderr[-2000:])
    failed = explain(_feed(res.stderr), read_records(tmp_path))
    assert next(iter(failed)) == 0 and failed[0].startswith("killed by SIGKILL"), failed
    assert lost_peer(RuntimeError("Read error: Connection reset by peer"))
    assert not lost_peer(RuntimeError("CUDA out of memory")) and not lost_peer(KeyError("x"))


def test_a_process_forked_from_a_rank_keeps_pythons_own_hooks(tmp_path: Path) -> None:
    """Two real ranks under mpiexec fork a child each (as a DataLoader worker is forked). In
    the child an exception reaches both hooks: through a reference to ``sys.excepthook``
    taken before the fork (as ``multiprocessing.resource_sharer`` calls it when the rank that
    talks to it dies) and from a thread. Neither records a death nor aborts: the child prints
    the tracebacks and leaves, and the job ends cleanly.

    Before: the child called ``MPI_Abort`` and hung, holding the rank's output pipes, so the
    launcher waited for it until ``ftkit run``'s attempt timeout."""
    code = ("import os, sys, threading\n"
            "from ftkit.comm.dist import install_abort_hooks\n"
            "from mpi4py import MPI\n"
            "install_abort_hooks()\n"
            "hook = sys.excepthook\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    try:\n"
            "        raise ConnectionResetError(104, 'Connection reset by peer')\n"
            "    except ConnectionResetError:\n"
            "        hook(*sys.exc_info())\n"
            "    def boom():\n"
            "        raise KeyError('from a thread of the child')\n"
            "    t = threading.Thread(target=boom)\n"
            "    t.start(); t.join()\n"
            "    sys.stderr.flush()\n"
            "    os._exit(0)\n"
            "_, status = os.waitpid(pid, 0)\n"
            "assert os.waitstatus_to_exitcode(status) == 0, status\n"
            "MPI.COMM_WORLD.Barrier()\n")
    res = _mpirun(code, tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    assert read_records(tmp_path) == []
    assert "aborting the MPI job" not in res.stderr
    assert res.stderr.count("ConnectionResetError: [Errno 104]") == 2, res.stderr
    assert res.stderr.count("KeyError: 'from a thread of the child'") == 2, res.stderr
