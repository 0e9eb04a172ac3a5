"""Declared shards (ftkit.declare_shard) and the optimizer state that follows them."""
from __future__ import annotations

from typing import Any

import pytest

import ftkit
from ftkit.capture.flatten import flatten
from ftkit.capture.shards import ShardSpec, describe, first_overlap, make_spec

torch = pytest.importorskip("torch")


def test_one_box_at_offsets() -> None:
    t = ftkit.declare_shard(torch.zeros(2, 3), (2, 6), (0, 3))
    spec = t._ftkit_shard
    assert spec.to_json() == {"global_shape": [2, 6], "chunks": [[[0, 3], [2, 3]]]}
    assert spec.dim == 1 and spec.numel == 6
    assert ShardSpec.from_json(spec.to_json(), 6) == spec


def test_fused_chunks_and_dims() -> None:
    # rank 1 of tp 2 of a fused [q; k; v] (3 blocks of 4 rows): rows 2-3, 6-7, 10-11
    t = ftkit.declare_shard(torch.zeros(6, 5), (12, 5),
                            chunks=[((2 + 4 * k, 0), (2, 5)) for k in range(3)])
    assert t._ftkit_shard.dim is None
    assert make_spec((4, 4), [((0, 0), (4, 4))]).dim == 0          # whole: "cut" along 0
    assert make_spec((4, 4), [((2, 2), (2, 2))]).dim is None       # cut along both


@pytest.mark.parametrize("args,kwargs,needle", [
    (((4, 6), (0, 4)), {}, "outside global shape"),
    (((4, 6),), {"chunks": [((0, 0), (2, 3)), ((1, 0), (2, 3))]}, "overlap"),
    (((4, 6),), {"chunks": [((0, 0), (1, 3))]}, "hold 3 elements, the tensor 6"),
    (((4, 6), (0,)), {}, "does not have the 2 dimensions"),
    (((), ()), {}, "scalar"),
    (((4, 6), (0, 0)), {"chunks": [((0, 0), (2, 3))]}, "either offsets or chunks"),
    (((4, -6), (0, 0)), {}, "non-negative integers"),
    (((4, 6), (0, True)), {}, "non-negative integers"),
])
def test_declarations_that_do_not_fit_are_refused(args: tuple[Any, ...],
                                                  kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ftkit.declare_shard(torch.zeros(2, 3), *args, **kwargs)


def test_only_torch_tensors_can_be_declared() -> None:
    import numpy as np
    with pytest.raises(TypeError, match="torch tensor"):
        ftkit.declare_shard(np.zeros(3), (6,), (0,))


@pytest.mark.parametrize("obj", [
    None, [], {"global_shape": [4]}, {"global_shape": [4], "chunks": 3},
    {"global_shape": [4], "chunks": [[[0], [4]], [[0]]]},
    {"global_shape": [4], "chunks": [[[0], [4]]], "x": 1},
    {"global_shape": [4], "chunks": [[["0"], [4]]]},
    {"global_shape": [4] * 65, "chunks": [[[0] * 65, [4] * 65]]},
    {"global_shape": [4], "chunks": []},
])
def test_hostile_specs_are_refused(obj: Any) -> None:
    with pytest.raises(ValueError):
        ShardSpec.from_json(obj)


def test_overlap_ignores_empty_boxes() -> None:
    spec = make_spec((4,), [((0,), (2,)), ((2,), (0,)), ((2,), (2,))])
    assert first_overlap(spec.chunks) is None
    assert first_overlap(make_spec((4,), [((0,), (3,))]).chunks * 2) == (0, 1)


def _trained(model: Any) -> Any:
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return opt


def test_optimizer_state_follows_its_parameter() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 1))
    ftkit.declare_shard(model[0].weight, (12, 4), (6, 0))      # rank 1 of a column split
    opt = _trained(model)
    state = {"model": model, "optim": opt}
    _, leaves = flatten(state)
    got = describe(state, leaves)
    paths = {leaf.path: str(i) for i, leaf in enumerate(leaves)}
    spec = {"global_shape": [12, 4], "chunks": [[[6, 0], [6, 4]]]}
    assert {leaves[int(i)].path for i in got["shards"]} == {
        "model/0.weight", "optim/state/0/exp_avg", "optim/state/0/exp_avg_sq"}
    assert all(v == spec for v in got["shards"].values())
    assert got["keys"][paths["optim/state/0/exp_avg"]] == "optim/state/model/0.weight/exp_avg"
    assert got["keys"][paths["optim/state/3/step"]] == "optim/state/model/1.bias/step"
    assert not any(leaf.startswith("model/") for leaf in
                   (leaves[int(i)].path for i in got["keys"]))


def test_plain_tensors_keep_their_declaration_and_a_resize_is_caught() -> None:
    t = ftkit.declare_shard(torch.zeros(2, 3), (4, 3), (2, 0))
    state = {"w": t, "n": torch.zeros(3)}
    _, leaves = flatten(state)
    assert describe(state, leaves) == {"shards": {"0": {"global_shape": [4, 3],
                                                        "chunks": [[[2, 0], [2, 3]]]}}}
    t.resize_(3, 3)
    _, leaves = flatten(state)
    with pytest.raises(ValueError, match="w: declared as a shard of 6 elements"):
        describe(state, leaves)


def test_nothing_declared_and_no_optimizer_adds_nothing() -> None:
    state = {"model": torch.nn.Linear(2, 2), "x": [1, 2]}
    _, leaves = flatten(state)
    assert describe(state, leaves) == {}


def test_cut_difference_names_a_piece_of_another_box() -> None:
    """Same local shapes, other boxes: named; an undeclared tensor equals a whole one."""
    from ftkit.capture.shards import cut_difference
    w = ftkit.declare_shard(torch.zeros(2, 3), (4, 6), (2, 3))
    state = {"model": {"w": w, "b": torch.zeros(4)}}
    leaves = flatten(state)[1]
    same = make_spec((4, 6), [((2, 3), (2, 3))])
    assert cut_difference({"model/w": same, "model/b": None}, state, leaves) is None
    other = make_spec((4, 6), [((0, 3), (2, 3))])
    why = cut_difference({"model/w": other}, state, leaves)
    assert why == ("model/w holds the box(es) [0, 3]+[2, 3] of [4, 6] in the checkpoint but "
                   "the box(es) [2, 3]+[2, 3] of [4, 6] in the state"), why
    assert cut_difference({"model/w": same, "model/b": make_spec((4,), [((0,), (4,))])},
                          state, leaves) is None
    assert "model/b holds the box(es) [0]+[4] of [8] in the checkpoint but whole [4]" in \
        cut_difference({"model/w": same, "model/b": make_spec((8,), [((0,), (4,))])}, state,
                       leaves)
    assert cut_difference({"model/w": None}, state, leaves).startswith("model/w holds whole")


def test_cut_difference_matches_tensors_by_path() -> None:
    """A checkpoint with optimizer state restored into a fresh optimizer (no state yet):
    the live leaves after the model do not line up with the saved ones, and nothing
    differs — saved tensors the live state lacks are not compared."""
    from ftkit.capture.shards import cut_difference
    lin = torch.nn.Linear(3, 2)
    ftkit.declare_shard(lin.weight, (4, 3), (2, 0))
    ftkit.declare_shard(lin.bias, (4,), (2,))
    opt = torch.optim.Adam(lin.parameters())
    lin(torch.ones(1, 3)).sum().backward()
    opt.step()
    saved_state = {"model": lin, "optim": opt, "rng": torch.zeros(5)}
    leaves = flatten(saved_state)[1]
    specs = describe(saved_state, leaves)["shards"]
    saved = {leaf.path: ShardSpec.from_json(specs[str(i)]) if str(i) in specs else None
             for i, leaf in enumerate(leaves)}
    fresh = {"model": lin, "optim": torch.optim.Adam(lin.parameters()), "rng": torch.zeros(5)}
    assert len(flatten(fresh)[1]) < len(leaves)
    assert cut_difference(saved, fresh, flatten(fresh)[1]) is None
