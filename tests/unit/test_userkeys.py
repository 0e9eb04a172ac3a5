"""``ftkit export`` writes the user's keys: ftkit's own tensors (a loader's generator, a DDP's
bucket layout) are left out, and a DDP's ``module.`` prefix is cut from the keys of its state
path (parameters and the optimizer state keyed by them), as torch's get_model_state_dict
does; a module that merely has a child named ``module`` keeps its keys."""
from __future__ import annotations

import dataclasses

from ftkit.capture.flatten import RESERVED
from ftkit.cli.userkeys import user_view


@dataclasses.dataclass
class It:
    key: str
    path: str


def _items(*paths: str) -> list[It]:
    return [It(p, p) for p in paths]


def test_ddp_prefix_cut_and_ftkits_tensors_left_out() -> None:
    items = _items("model/module.fc.weight", "model/module.fc.bias",
                   f"model/{RESERVED}/ddp_buckets", "optim/state/model/module.fc.weight/exp_avg",
                   f"data/{RESERVED}/generator", "data/pos", "other/module.x")
    assert [i.key for i in user_view(items)] == [
        "model/fc.weight", "model/fc.bias", "optim/state/model/fc.weight/exp_avg", "data/pos",
        "other/module.x"]


def test_keys_of_a_module_that_was_not_a_ddp_are_kept() -> None:
    plain = _items("model/module.w", "model/head.w")               # no DDP mark
    assert [i.key for i in user_view(plain)] == ["model/module.w", "model/head.w"]
    mixed = _items("model/module.w", "model/head.w", f"model/{RESERVED}/ddp_buckets")
    assert [i.key for i in user_view(mixed)] == ["model/module.w", "model/head.w"]
