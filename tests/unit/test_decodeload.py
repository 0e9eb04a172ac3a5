"""Which pieces a lost erasure-set member's file is decoded from, as it streams (pure)."""
from __future__ import annotations

from ftkit.storage.redundancy.decodeload import pieces, xor_terms
from ftkit.storage.redundancy.fetch import PIECE
from ftkit.storage.redundancy.stripes import Layout


def test_an_xor_member_is_the_xor_of_the_others_segments_and_parity():
    lay = Layout(4, 1)
    terms = xor_terms(lay, 1, [1], [True, False, True, True], [True] * 4)
    assert terms is not None and len(terms) == lay.m
    for q, ts in enumerate(terms):
        t = [u for u in range(lay.k) if 1 in lay.data_members(u)][q]
        owners = sorted(owner for owner, _, _ in ts)
        assert owners == sorted(m for m in range(4) if m != 1)
        assert [kind for owner, kind, _ in ts if owner == lay.holders(t)[0]] == ["p"]


def test_a_decode_that_needs_other_coefficients_or_cannot_decode_does_not_stream():
    assert xor_terms(Layout(4, 2), 0, [0], [False, True, True, True], [True] * 4) is None
    assert xor_terms(Layout(3, 1), 0, [0, 1], [False, False, True], [True] * 3) is None


def test_pieces_cover_the_file_in_order_and_stop_at_its_size():
    lay = Layout(2, 1)
    terms = xor_terms(lay, 1, [1], [True, False], [True, True])
    assert terms is not None
    seg, size = 3 * PIECE, 2 * PIECE + 100
    got = pieces(terms, seg, size)
    assert [(p.at, p.n, p.offset) for p in got] == [
        (0, PIECE, 0), (PIECE, PIECE, PIECE), (2 * PIECE, 100, 2 * PIECE)]
