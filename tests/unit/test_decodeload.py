"""Which pieces a lost erasure-set member's file is decoded from, as it streams (pure)."""
from __future__ import annotations

import numpy as np

from ftkit.storage.redundancy import gf256
from ftkit.storage.redundancy.decodeload import _combine, decode_terms, pieces
from ftkit.storage.redundancy.fetch import PIECE
from ftkit.storage.redundancy.stripes import Layout


def test_an_xor_member_is_the_xor_of_the_others_segments_and_parity():
    lay = Layout(4, 1)
    terms = decode_terms(lay, 1, [1], [True, False, True, True], [True] * 4)
    assert terms is not None and len(terms) == lay.m
    for q, ts in enumerate(terms):
        t = [u for u in range(lay.k) if 1 in lay.data_members(u)][q]
        owners = sorted(owner for owner, *_ in ts)
        assert owners == sorted(m for m in range(4) if m != 1)
        assert [kind for owner, kind, *_ in ts if owner == lay.holders(t)[0]] == ["p"]
        assert {c for *_, c in ts} == {1}


def test_decode_terms_rebuild_lost_reed_solomon_members_exactly():
    """Two members of a k=4, p=2 set lost: the terms (segments and GF(256) coefficients)
    of each lost segment, summed as the receiver sums pieces, give back its bytes."""
    lay, s = Layout(4, 2), 64
    rng = np.random.default_rng(0)
    data = [[rng.integers(0, 256, s, dtype=np.uint8) for _ in range(lay.m)]
            for _ in range(lay.k)]
    parity = [[np.zeros(s, np.uint8) for _ in range(lay.p)] for _ in range(lay.k)]
    for t in range(lay.k):
        for j, h in enumerate(lay.holders(t)):
            for x, mem in enumerate(lay.data_members(t)):
                gf256.mad_into(parity[h][lay.parity_slot(h, t)], lay.coef[j][x],
                               data[mem][lay.seg_index(mem, t)])
    lost = [0, 2]
    ok = [m not in lost for m in range(lay.k)]
    coefs = set()
    for gone in lost:
        terms = decode_terms(lay, gone, lost, ok, ok)
        assert terms is not None and len(terms) == lay.m
        for q, ts in enumerate(terms):
            bufs = [(data if kind == "d" else parity)[owner][idx].copy()
                    for owner, kind, idx, _ in ts] + [np.empty(s, np.uint8)]
            assert np.array_equal(_combine(ts, bufs), data[gone][q]), (gone, q)
            coefs |= {c for *_, c in ts}
    assert coefs - {1}                       # a real Reed-Solomon decode, not only XOR


def test_a_stripe_that_cannot_be_decoded_gives_none():
    assert decode_terms(Layout(3, 1), 0, [0, 1], [False, False, True], [True] * 3) is None


def test_pieces_cover_the_file_in_order_and_stop_at_its_size():
    lay = Layout(2, 1)
    terms = decode_terms(lay, 1, [1], [True, False], [True, True])
    assert terms is not None
    seg, size = 3 * PIECE, 2 * PIECE + 100
    got = pieces(terms, seg, size)
    assert [(p.at, p.n, p.offset) for p in got] == [
        (0, PIECE, 0), (PIECE, PIECE, PIECE), (2 * PIECE, 100, 2 * PIECE)]
