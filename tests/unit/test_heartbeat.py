"""The heartbeat ring's local parts (one process: the ring of ``COMM_SELF`` is its own
neighbour), ending a hung process, and the FTKIT_HEARTBEAT setting. A real hang replaced in
the job: tests/e2e/test_in_job.py."""
from __future__ import annotations

import subprocess
import sys

import pytest
from mpi4py import MPI

from ftkit.config import Config
from ftkit.errors import ConfigError
from ftkit.injob import heartbeat
from ftkit.injob.heartbeat import Peer, Ring


def _poll_until_heard(ring: Ring, now: float) -> None:
    """Poll at ``now`` until the beat sent to itself arrives (MPI progress, no sleep)."""
    for _ in range(10_000):
        assert ring.poll(now) is None
        if ring.heard == now:
            return
    raise AssertionError("the ring's own beat never arrived")


def test_a_ring_knows_its_neighbour_and_hears_its_beats() -> None:
    ring = Ring(MPI.COMM_SELF, logical=3, deadline=4.0, now=0.0)
    try:
        assert ring.peer == ring.me and ring.peer.logical == 3
        assert ring.period == 1.0
        assert ring.poll(0.5) is None           # first beat sent at once
        _poll_until_heard(ring, 0.6)
        assert ring.poll(4.5) is None           # 3.9 s silent: within the deadline
        _poll_until_heard(ring, 4.6)            # the beat sent at 4.5
    finally:
        ring.close()


def test_silence_past_the_deadline_is_reported_with_its_length() -> None:
    ring = Ring(MPI.COMM_SELF, logical=0, deadline=4.0, now=10.0)
    try:
        ring.take(13.0)                         # nothing sent: nothing heard
        assert ring.heard == 10.0
        assert ring.overdue(14.0) is None       # exactly the deadline: not yet
        assert ring.overdue(20.0) == pytest.approx(10.0)
        ring.beat(20.0)
        _poll_until_heard(ring, 20.5)           # a beat ends the silence
        assert ring.overdue(24.0) is None
    finally:
        ring.close()


def test_identity_survives_the_exchange_and_names_the_rank() -> None:
    me = Peer(process=5, logical=-1, pid=1234, system="host-a/4026531836")
    assert heartbeat._decode(heartbeat._encode(me)) == me
    assert me.describe() == "a spare (process 5, pid 1234 on host-a)"
    worker = Peer(process=2, logical=2, pid=99, system=heartbeat.system_id())
    assert worker.describe().startswith("rank 2 (process 2, pid 99 on ")


def test_end_kills_a_stopped_process_of_this_machine_only() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        child.send_signal(19)                   # SIGSTOP: hung, not dead
        me = Peer(0, 0, 1, heartbeat.system_id())
        elsewhere = Peer(1, 1, child.pid, "another-host/1")
        assert heartbeat.end(elsewhere, me) is False
        assert child.poll() is None
        assert heartbeat.end(Peer(1, 1, child.pid, me.system), me) is True
        assert child.wait(timeout=30) == -9
    finally:
        if child.poll() is None:
            child.kill()


@pytest.mark.parametrize("raw,ok", [("0", 0.0), ("2.5", 2.5), ("0.5", None), ("-1", None),
                                    ("nan", None), ("soon", None)])
def test_heartbeat_setting(raw: str, ok: float | None) -> None:
    if ok is None:
        with pytest.raises(ConfigError, match="FTKIT_HEARTBEAT"):
            Config.load(env={"FTKIT_HEARTBEAT": raw})
    else:
        assert Config.load(env={"FTKIT_HEARTBEAT": raw}).heartbeat == ok
    assert Config.load(env={}).heartbeat == 30.0
