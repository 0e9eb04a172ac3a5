"""ftkit.progress: the no-progress deadline every wait of ftkit uses."""
from __future__ import annotations

import threading

import pytest

from ftkit.progress import MIN_BULK_BANDWIDTH, NoProgress, bulk_seconds


def test_bulk_seconds_adds_the_bytes_at_the_slowest_bandwidth() -> None:
    assert bulk_seconds(10, 0) == 10
    assert bulk_seconds(10, int(MIN_BULK_BANDWIDTH * 3)) == pytest.approx(13)
    assert bulk_seconds(10, -5) == 10


def test_expires_after_seconds_without_progress() -> None:
    clock = NoProgress(5, now=100.0)
    assert not clock.expired(104.9) and clock.remaining(104) == pytest.approx(1)
    assert not clock.expired(105.0) and clock.expired(105.01)     # more than 5 s
    clock.progress(now=104.0)                  # progress restarts the clock
    assert not clock.expired(108.9) and clock.expired(109.01)
    assert clock.since(108.0) == pytest.approx(4)


def test_announced_bytes_extend_the_deadline_until_the_next_progress() -> None:
    big = int(MIN_BULK_BANDWIDTH * 2)          # two seconds at the slowest bandwidth
    clock = NoProgress(5, nbytes=big, now=0.0)
    assert clock.allowed == pytest.approx(7)
    assert not clock.expired(6.9) and clock.expired(7.01)
    clock.progress(now=6.0)                    # no more bytes announced: seconds only
    assert clock.allowed == 5 and clock.expired(11.01)


def test_progress_from_another_thread_is_seen() -> None:
    times = iter([0.0, 4.0, 8.0])
    clock = NoProgress(5, clock=lambda: next(times))        # created at 0
    worker = threading.Thread(target=clock.progress, kwargs={"nbytes": 0})
    worker.start()                                          # progress at 4
    worker.join()
    assert not clock.expired()                              # 8 - 4 < 5
