"""In-job recovery's local parts: roles after a failure, the failure flag, the sockets shut
down, the spare-rank setting, the ULFM launch line and the rank-process finder (the
recovery itself: tests/e2e/test_in_job.py)."""
from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ftkit.comm import flag
from ftkit.errors import ConfigError, LaunchError
from ftkit.injob import sockets
from ftkit.injob.deadline import Deadline
from ftkit.injob.fallback import who
from ftkit.injob.membership import NotEnoughSpares, assign
from ftkit.injob.resilient import spare_ranks
from ftkit.launch.mpiexec import MPICH, OPENMPI, SPARES_ENV, MpiexecLauncher
from ftkit.testing.procs import rank_processes


def test_spares_take_the_failed_ranks_in_order() -> None:
    # 4 working ranks, spares are processes 4 and 5; logical ranks 1 and 3 died
    got = assign({0: 0, 2: 2, 4: -1, 5: -1}, 4)
    assert got.failed == [1, 3]
    assert got.replaced == {1: 4, 3: 5}
    assert got.roles == {0: 0, 2: 2, 4: 1, 5: 3}
    assert got.spares_left == 0


def test_a_spare_that_replaced_a_rank_keeps_it_and_idle_spares_stay_idle() -> None:
    # generation 2: process 4 took rank 1 earlier; now rank 0 (process 0) died
    got = assign({1: -1, 2: 2, 3: 3, 4: 1, 5: -1, 6: -1}, 4)
    assert got.failed == [0] and got.replaced == {0: 1}
    assert got.roles[4] == 1 and got.roles[5] == -1 and got.roles[6] == -1
    assert got.spares_left == 2


def test_no_failure_changes_nothing() -> None:
    got = assign({0: 0, 1: 1, 2: -1}, 2)
    assert got.failed == [] and got.replaced == {} and got.roles == {0: 0, 1: 1, 2: -1}


def test_more_failures_than_spares_is_refused_naming_them() -> None:
    with pytest.raises(NotEnoughSpares, match=r"2 working rank\(s\) failed \(0, 2\) and 1 "
                                              r"spare"):
        assign({1: 1, 3: 3, 4: -1}, 4)


def test_a_failed_rank_is_taken_on_its_nodes_host() -> None:
    # virtual nodes of 2 on one machine: the spare there takes rank 2, node 1's rank 3 stays
    hosts = {p: "vm" for p in range(6)}
    got = assign({0: 0, 1: 1, 3: 3, 4: -1, 5: -1}, 4, hosts, [0, 0, 1, 1],
                 {lr: lr for lr in range(4)})
    assert got.replaced == {2: 4} and got.moved == [] and got.spares_left == 1


SLURM_HOSTS = {0: "n1", 1: "n1", 2: "n2", 3: "n2", 4: "n3", 5: "n3"}     # n3: a spare node


def test_a_node_whose_host_has_no_spare_moves_whole_to_a_spare_host() -> None:
    # rank 3's process died on n2 (no spare there): node 1 moves to n3, rank 2's live
    # process becomes a spare
    got = assign({0: 0, 1: 1, 2: 2, 4: -1, 5: -1}, 4, SLURM_HOSTS, [0, 0, 1, 1],
                 {lr: lr for lr in range(4)})
    assert got.failed == [3] and got.moved == [2]
    assert got.replaced == {2: 4, 3: 5}
    assert got.roles == {0: 0, 1: 1, 2: -1, 4: 2, 5: 3}
    assert got.spares_left == 1


def test_a_lost_node_goes_to_the_spare_host() -> None:
    got = assign({0: 0, 1: 1, 4: -1, 5: -1}, 4, SLURM_HOSTS, [0, 0, 1, 1],
                 {lr: lr for lr in range(4)})
    assert got.failed == [2, 3] and got.moved == [] and got.replaced == {2: 4, 3: 5}


def test_spares_split_over_hosts_cannot_take_a_node() -> None:
    hosts = {**SLURM_HOSTS, 5: "n4"}
    with pytest.raises(NotEnoughSpares, match="not 2 on one host for node 1"):
        assign({0: 0, 1: 1, 4: -1, 5: -1}, 4, hosts, [0, 0, 1, 1],
               {lr: lr for lr in range(4)})


def test_spare_ranks_setting() -> None:
    assert spare_ranks({}) is None
    assert spare_ranks({SPARES_ENV: " 2 "}) == 2
    assert spare_ranks({SPARES_ENV: "0"}) == 0
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(ConfigError, match=SPARES_ENV):
            spare_ranks({SPARES_ENV: bad})


def test_in_job_launch_line_and_environment() -> None:
    mpi = MpiexecLauncher(path="/x/mpiexec", flavor=OPENMPI).in_job(2)
    argv = mpi.command(4, ["python", "train.py"])
    assert argv[:1] == ["/x/mpiexec"]
    assert "--with-ft" in argv and argv[argv.index("--with-ft") + 1] == "ulfm"
    assert argv[argv.index("btl") + 1] == "tcp,self"        # shared memory hangs survivors
    assert argv[argv.index("-n") + 1] == "6"                 # 4 working ranks + 2 spares
    assert mpi.environ({})[SPARES_ENV] == "2"
    plain = MpiexecLauncher(path="/x/mpiexec", flavor=OPENMPI)
    assert "--with-ft" not in plain.command(4, ["python", "t.py"])
    assert SPARES_ENV not in plain.environ({})
    with pytest.raises(LaunchError, match="Open MPI 5 with ULFM"):
        MpiexecLauncher(path="/x/mpiexec", flavor=MPICH).in_job(1)


@pytest.fixture
def clean_flag() -> None:
    flag._FLAG.__init__()       # type: ignore[misc]
    yield
    flag._FLAG.__init__()       # type: ignore[misc]


def test_flag_trips_once_and_waits_end(clean_flag: None) -> None:
    flag.check("idle")                                   # nothing known: no error
    assert flag.trip("rank 3 died") and not flag.trip("echo")
    assert flag.reason() == "rank 3 died" and flag.tripped_at() > 0
    with pytest.raises(flag.PeerLost, match="phase x: a peer rank failed \\(rank 3 died\\)"):
        flag.check("phase x")
    flag.next_generation()
    assert not flag.tripped() and flag.generation() == 1
    assert flag.take_first_step() and not flag.take_first_step()
    assert flag.last_failure_at() > 0


def test_abandon_all_reaches_every_owned_object_even_after_an_error(clean_flag: None) -> None:
    calls = []

    class Owned:
        def __init__(self, fail: bool) -> None:
            self.fail = fail

        def abandon(self) -> None:
            calls.append(self)
            if self.fail:
                raise RuntimeError("stuck")
    a, b = Owned(True), Owned(False)
    flag.own(a)                                         # not active: not registered
    assert flag.abandon_all() == [] and calls == []
    flag.activate()
    flag.own(a)
    flag.own(b)
    assert flag.abandon_all() == ["RuntimeError: stuck"]
    assert set(calls) == {a, b} and flag.abandon_all() == []


def test_shut_down_wakes_a_reader_blocked_on_a_recorded_connection() -> None:
    """A thread blocked in recv on a recorded connection returns at once when another
    thread shuts the sockets down; sockets opened outside the recording stay usable."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    outside = socket.create_connection(("127.0.0.1", port))
    outside_peer, _ = server.accept()
    recorded = sockets.recording(lambda: socket.create_connection(("127.0.0.1", port)))
    peer, _ = server.accept()
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(recorded.recv(10)))
    reader.start()
    assert sockets.shut_down() == 1
    reader.join(5)
    assert not reader.is_alive() and got == [b""]       # end of file, not a hang
    assert peer.recv(10) == b""                          # the peer sees it closed too
    outside.sendall(b"ok")
    assert outside_peer.recv(10) == b"ok"               # not recorded: untouched
    assert sockets.shut_down() == 0                      # recorded sockets are forgotten
    for s in (server, outside, outside_peer, recorded, peer):
        s.close()


def test_teardown_resets_torchs_group_counter_after_a_failed_init() -> None:
    """A generation whose init_process_group failed midway left torch's default-group
    counter ahead (no default group, so destroy_process_group is not called): the
    teardown resets it, or the next generation's ranks would name their groups apart."""
    from torch.distributed import distributed_c10d as c10d

    from ftkit.injob.resilient import _teardown
    assert not c10d.is_initialized()
    c10d._world.group_count = 1                     # as a failed init_process_group leaves
    _teardown()
    assert c10d._world.group_count == 0


def test_the_store_of_a_dead_rank_0_does_not_hold_an_in_job_rank(clean_flag: None) -> None:
    """Under in-job recovery, making the rendezvous store (a client retrying to connect
    to rank 0's server) runs on a helper thread: once a peer's failure is known the caller
    raises PeerLost at once, not at the store's timeout."""
    from ftkit.torchdist import _interruptible
    release = threading.Event()
    flag.activate()
    threading.Timer(0.2, lambda: flag.trip("rank 0 died")).start()
    t0 = time.monotonic()
    with pytest.raises(flag.PeerLost, match="the rendezvous store"):
        _interruptible(lambda: release.wait(60), 60.0, "the rendezvous store")
    assert time.monotonic() - t0 < 5
    release.set()


def test_rank_processes_finds_a_job_by_directory_and_rank(tmp_path: Path) -> None:
    """The helper tests and benchmarks kill ranks with: processes of this directory whose
    ``OMPI_COMM_WORLD_RANK`` is asked for, nothing else."""
    env = {**os.environ, "OMPI_COMM_WORLD_RANK": "3"}
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    procs = [subprocess.Popen(["sleep", "30"], cwd=cwd, env=env)
             for cwd in (tmp_path, elsewhere)]
    try:
        for p in procs:             # exec'd, and its environment set up (exec sets that
            deadline = time.monotonic() + 30    # last: the file reads empty before)
            while not (os.readlink(f"/proc/{p.pid}/exe").endswith("sleep")
                       and Path(f"/proc/{p.pid}/environ").read_bytes()):
                assert time.monotonic() < deadline, "sleep never started"
        assert rank_processes(tmp_path, [3]) == {3: procs[0].pid}
        assert rank_processes(tmp_path, [2]) == {}
        assert rank_processes(elsewhere, [3, 4]) == {3: procs[1].pid}
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_recovery_that_hangs_falls_back_at_its_deadline(
        capfd: pytest.CaptureFixture[str]) -> None:
    """A recovery still running FTKIT_TIMEOUT after the failure became known: the timer
    thread writes every thread's stack and falls back (aborts the world) naming the phase
    the process was stuck in, while the main thread is still blocked."""
    called: list[tuple[str, int]] = []
    fired = threading.Event()

    def fake(why: str, rank: int) -> None:
        called.append((why, rank))
        fired.set()
    d = Deadline(0.05, 3, fake)
    d.enter("teardown")
    d.arm()
    assert d.armed and fired.wait(10)       # the recovery "hangs" until the deadline fires
    why = ("the recovery did not finish within 0.05 s of the failure (FTKIT_TIMEOUT): "
           "this process was still in its teardown")
    assert called == [(why, 3)]
    err = capfd.readouterr().err
    assert f"rank 3: {why}; the stacks of its threads:" in err
    assert "test_a_recovery_that_hangs_falls_back_at_its_deadline" in err   # this thread
    assert "ftkit-recovery-deadline" in err or "_expire" in err             # the timer's


def test_a_recovery_in_time_leaves_no_timer() -> None:
    called: list[str] = []
    before = set(threading.enumerate())
    d = Deadline(30, 0, lambda why, rank: called.append(why))
    d.arm()
    d.arm()                                  # armed once
    timers = [t for t in threading.enumerate() if t not in before]
    d.cancel()
    d.arm()                                  # after the recovery: never again
    for t in timers:
        t.join(5)
    assert len(timers) == 1 and not timers[0].is_alive() and called == [] and not d.armed
    assert set(threading.enumerate()) <= before | set(timers)


def test_a_deadline_never_armed_never_fires() -> None:
    """No failure in the generation (the job ended): no timer at all."""
    called: list[str] = []
    before = set(threading.enumerate())
    d = Deadline(0.01, 0, lambda why, rank: called.append(why))
    d.cancel()
    assert set(threading.enumerate()) == before and called == [] and not d.armed


def test_who_names_a_process_the_way_the_attempt_line_does() -> None:
    """A spare or a rank taken over by a spare is named with its process (the launcher's
    numbering), never as logical rank 0."""
    assert who(-1, 5) == "spare process 5"
    assert who(2, 2) == "rank 2"
    assert who(2, 4) == "rank 2 (process 4)"


def test_the_watch_starts_the_recovery_deadline_when_it_learns_of_a_failure(
        clean_flag: None) -> None:
    """Whichever thread trips the flag, the watch's alarm starts the recovery deadline's
    clock (``on_alarm``): the main thread tripping it (``_peer_failure``), the watcher
    seeing it and alarming once more (the clock starts once: ``Deadline.arm``)."""
    from mpi4py import MPI

    from ftkit.injob.watch import Watch
    world = MPI.COMM_SELF.Dup()
    started: list[float] = []
    fired: list[str] = []
    d = Deadline(30, 0, lambda why, rank: fired.append(why))
    try:
        watch = Watch(world, None, 0, 0.0, lambda: (started.append(time.monotonic()),
                                                   d.arm()))
        assert not started and not d.armed           # no failure: no clock
        flag.trip("rank 1 died")                     # as the training loop's error does
        watch.join(10)
        assert started and d.armed and flag.reason() == "rank 1 died"
        watch.alarm("again")                         # the main thread's alarm: no new clock
        assert d.armed and not fired
    finally:
        d.cancel()
        world.Free()


def test_a_wait_for_another_thread_ends_when_a_peer_fails(clean_flag: None) -> None:
    """In-job: a thread waiting for another thread's future (the training loop for the
    checkpoint thread, that one for the flush) raises PeerLost as soon as the flag trips,
    whatever the other thread is blocked in, not after its patience."""
    import concurrent.futures as cf
    flag.activate()
    never: cf.Future[None] = cf.Future()
    threading.Timer(0.1, flag.trip, ("rank 3 died",)).start()
    t0 = time.monotonic()
    with pytest.raises(flag.PeerLost, match="the background checkpoint: a peer rank failed"):
        flag.wait_done(never, 60, "the background checkpoint")
    assert time.monotonic() - t0 < 5


def test_a_wait_for_another_thread_keeps_its_timeout_and_result(clean_flag: None) -> None:
    """Without a failure (in-job or not): done futures return at once without fetching the
    result (the caller does), a future never done raises TimeoutError at the timeout; an
    abandoned Checkpointer's wait (an older generation) ends with PeerLost."""
    import concurrent.futures as cf
    done: cf.Future[None] = cf.Future()
    done.set_exception(ValueError("the checkpoint's own error"))
    never: cf.Future[None] = cf.Future()
    for active in (False, True):
        if active:
            flag.activate()
        flag.wait_done(done, 1, "x")                     # its error is the caller's to fetch
        with pytest.raises(cf.TimeoutError):
            flag.wait_done(never, 0.12, "x")
    flag.next_generation()
    with pytest.raises(flag.PeerLost, match="abandoned"):
        flag.wait_done(never, 60, "x", generation=0)
