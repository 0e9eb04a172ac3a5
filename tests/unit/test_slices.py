"""The slices of a shared snapshot: balanced, aligned, covering every replicated byte once,
and each kept by two neighbouring ring positions."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ftkit.capture.flatten import flatten
from ftkit.capture.slices import ALIGN, Span, holders, kept, kept_leaves, plan
from ftkit.capture.staging import Stager
from ftkit.storage.shard import Shard, write_shard


def test_a_slice_may_cut_a_tensor_and_skips_empty_ones():
    got = plan([(0, 1000), (3, 0), (5, 600)], 2)
    assert [(s.index, s.start, s.nbytes) for s in got] == [(0, 0, 768), (1, 768, 832)]
    assert got[0].spans == (Span(0, 0, 768),)
    assert got[1].spans == (Span(0, 768, 232), Span(5, 0, 600))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=12), st.integers(1, 9))
def test_slices_cover_every_byte_once_in_order(sizes, parts):
    leaves = list(enumerate(sizes))
    got = plan(leaves, parts)
    total = sum(sizes)
    assert [s.index for s in got] == list(range(parts))
    assert sum(s.nbytes for s in got) == total
    assert all(s.start % ALIGN == 0 for s in got)
    assert max(s.nbytes for s in got) - min(s.nbytes for s in got) < 2 * ALIGN
    flat = [(span.leaf, span.start + i) for s in got for span in s.spans
            for i in range(span.nbytes)]
    assert flat == [(leaf, i) for leaf, n in leaves for i in range(n)]
    for s in got:
        assert sum(span.nbytes for span in s.spans) == s.nbytes
        assert all(span.nbytes > 0 for span in s.spans)


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
def test_every_slice_is_kept_by_two_neighbours(parts):
    for k in range(parts):
        assert all(k in kept(p, parts) for p in holders(k, parts))
        assert len(holders(k, parts)) == min(2, parts)
    assert sorted(k for p in range(parts) for k in kept(p, parts)) == \
        sorted(list(range(parts)) * min(2, parts))


def test_no_slices_of_nothing():
    with pytest.raises(ValueError, match="at least 1 slice"):
        plan([(0, 10)], 0)


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_each_replica_writes_its_two_slices_and_the_rest_whole(tmp_path, parts):
    """A state of torch and NumPy tensors, all replicated but ``own``: at every ring
    position the file holds ``own`` whole and the spans of its two slices (views of the
    live tensors, named by their first byte); written and read back, the spans of all
    positions put every replicated byte back twice, and the share table says where."""
    state = {"w": torch.arange(300, dtype=torch.float32), "b": torch.ones(7, dtype=torch.int16),
             "own": torch.full((3,), 9.0), "np": np.arange(50, dtype=np.float64),
             "empty": torch.zeros(0)}
    _, leaves = flatten(state)
    own = [leaf.path for leaf in leaves].index("own")
    replicated = [i for i in range(len(leaves)) if i != own]
    whole = b"".join(buf.tobytes() for buf in Stager().capture(   # the capture uses leaves up
        [leaves[i] for i in replicated]))
    seen: dict[int, int] = {}
    for position in range(parts):
        tree, leaves = flatten(state)
        out, share = kept_leaves(leaves, replicated, parts, position)
        assert out[0] is leaves[own] and share["whole"] == [own]
        assert share["kept"] == list(kept(position, parts))
        assert [r["index"] for r in share["replicated"]] == replicated
        spans = out[1:]
        assert [s.path for s in spans] == [f"{leaves[i].path}@{a}"
                                           for _, i, a, _ in share["spans"]]
        live = [x for x in spans if x.path.startswith("w@")]
        assert all(x.source.untyped_storage().data_ptr() ==
                   state["w"].untyped_storage().data_ptr() for x in live)
        path = tmp_path / f"rank-{position}.ftk"
        write_shard(path, {"step": 1, "rank": position, "world": parts, "share": share},
                    tree, out, Stager().capture(out))
        with Shard.open(path) as shard:
            for j, (k, i, a, n) in enumerate(share["spans"]):
                got = shard.raw(1 + j).tobytes()
                at = sum(leaves[r].nbytes for r in replicated[:replicated.index(i)]) + a
                assert got == whole[at:at + n]
                for x in range(at, at + n):
                    seen[x] = seen.get(x, 0) + 1
    assert all(seen.get(x) == min(2, parts) for x in range(len(whole)))
