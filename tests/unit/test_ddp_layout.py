"""The saved gradient-bucket layout of a DDP (ftkit.capture.ddp) is checked before it is put
back, and what ftkit saves beside an object's state is rank-local (a reshard gives each rank
its template rank's, never compares replicas)."""
from __future__ import annotations

import pytest

from ftkit.capture import ddp
from ftkit.capture.flatten import RESERVED, flatten, reserved
from ftkit.capture.rng import rank_local_indices

torch = pytest.importorskip("torch")


def _params() -> list[object]:
    return [torch.zeros(3), torch.zeros(2), torch.zeros(4, dtype=torch.float64)]


def test_a_saved_layout_becomes_buckets_of_parameter_indices() -> None:
    value = torch.tensor([[1, 0, 2], [0, 0, 1]])
    assert ddp._buckets(value, _params()) == [[1, 0], [2]]
    assert ddp._buckets(torch.full((2, 3), -1), _params()) == []      # the initial layout


@pytest.mark.parametrize("value", [
    [[1, 0], [0, 0]],                     # another number of parameters
    [[1, 1, 2], [0, 0, 1]],               # not a permutation
    [[1, 0, 2], [0, 1, 0]],               # buckets out of order
    [[1, 0, 2], [1, 1, 2]],               # not starting at bucket 0
    [[1, 2, 0], [0, 0, 1]],               # float32 and float64 in one bucket
])
def test_a_layout_that_does_not_fit_the_parameters_is_refused(value: list[list[int]]) -> None:
    assert ddp._buckets(torch.tensor(value), _params()) is None


class _Loaderish:
    def state_dict(self) -> dict[str, object]:
        return {"pos": torch.tensor(5)}

    def load_state_dict(self, sd: dict[str, object]) -> None:
        pass


def test_what_ftkit_saves_beside_an_object_is_rank_local() -> None:
    state = {"model": torch.nn.Linear(2, 2), "data": _Loaderish()}
    tree, leaves = flatten(state, lambda obj: {"generator": torch.zeros(4, dtype=torch.uint8)}
                           if isinstance(obj, _Loaderish) else None)
    local = rank_local_indices(tree)
    assert [leaves[i].path for i in sorted(local)] == [f"data/{RESERVED}/generator"]
    assert reserved(f"data/{RESERVED}/generator") and not reserved("data/pos")
