"""Errors that a relaunch would meet again are marked so (``recurs``): a rank that skipped a
``save`` (the protocol runs out of step: the line names it and what it called instead) and a
step aborted only by torn snapshots (the program changes the tensor at the same place)."""
from __future__ import annotations

import pytest

from ftkit.capture.staging import TornSnapshotError
from ftkit.comm.dist import describe
from ftkit.errors import CheckpointError
from ftkit.protocol.twophase import CLOSING, Outcome, ProtocolMismatch, out_of_step, raise_if_failed


def test_the_ranks_that_skipped_a_save_are_named() -> None:
    assert out_of_step([10, 10, 10, 11]) == (
        "rank 3 did not call save(10) (rank 3 called save(11) while ranks 0, 1, 2 called "
        "save(10)): every rank must call save() with the same steps")
    assert out_of_step([7, CLOSING]).startswith(
        "rank 1 did not call save(7) (rank 1 called close() while rank 0 called save(7))")
    many = out_of_step([1] + [2] * 12)
    assert many.startswith("ranks 1, 2, 3, 4, 5, 6, 7, 8 and 4 more did not call save(1)")
    assert ProtocolMismatch(1, {}).recurs


def _outcome(failures: dict[int, str]) -> Outcome:
    return Outcome(4, False, failures, 0.1)


def test_a_step_aborted_by_torn_snapshots_only_recurs() -> None:
    torn = describe(TornSnapshotError("model/w", 4))
    with pytest.raises(CheckpointError) as info:
        raise_if_failed(_outcome({0: torn, 2: torn}))
    assert info.value.recurs and "tensor model/w (step 4) changed in place" in str(info.value)
    with pytest.raises(CheckpointError) as info:
        raise_if_failed(_outcome({0: torn, 1: "OSError: [Errno 28] No space left on device"}))
    assert not info.value.recurs
