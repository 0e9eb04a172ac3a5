"""The slices of a shared snapshot: balanced, aligned, covering every replicated byte once,
and each kept by two neighbouring ring positions."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ftkit.capture.slices import ALIGN, Span, holders, kept, plan


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
