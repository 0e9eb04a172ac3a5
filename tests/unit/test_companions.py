"""A scheduler of a saved optimizer, or a weight average (EMA), left out of the state is named
in a warning before the first step (a resumed run would start it over); held in the state, or
tied to an optimizer the state does not hold, nothing is said."""
from __future__ import annotations

import logging

import pytest

from ftkit.capture import attached
from ftkit.capture.companions import left_out

torch = pytest.importorskip("torch")


class OneRank:
    rank = 0

    def agree(self, failure: str | None, _phase: str, _step: int) -> dict[int, str]:
        return {0: failure} if failure else {}


def _training() -> tuple[object, object, object, object]:
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    ema = torch.optim.swa_utils.AveragedModel(model)
    return model, opt, sched, ema


def test_a_scheduler_and_an_average_left_out_are_named(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    model, opt, sched, ema = _training()
    with caplog.at_level(logging.WARNING, logger="ftkit"):
        attached.admit(OneRank(), {"model": model, "optim": opt})
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("a LambdaLR of the optimizer state['optim'] is not in the state: "
                            "a resumed run would start its schedule over") for m in said), said
    assert any(m.startswith("an AveragedModel (EMA/SWA) is not in the state") for m in said)
    assert left_out({"model": model, "optim": opt, "sched": sched, "ema": ema}) == []
    del sched, ema


def test_a_scheduler_of_another_optimizer_is_not_named() -> None:
    model = torch.nn.Linear(3, 3)
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(other, 5)
    assert left_out({"optim": torch.optim.SGD(model.parameters(), lr=0.1)}) == []
    del sched
