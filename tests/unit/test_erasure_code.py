"""GF(256) arithmetic, the stripe layout, and a pure NumPy simulation of the XOR/RS code.

The simulation follows ErasureLevel._reduce_parity (encode) and ErasureLevel._decode (rebuild)
step by step, with the MPI Ireduce(BXOR) replaced by an XOR sum over the contributions.
"""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from ftkit.storage.redundancy import gf256
from ftkit.storage.redundancy.erasure import segment_size
from ftkit.storage.redundancy.stripes import Layout, piece_of, segments
from ftkit.storage.shard import ALIGN

SHAPES = [(k, p) for k in range(2, 7) for p in range(1, k)]


# ---------------------------------------------------------------------------- GF(256)
def slow_mul(a: int, b: int) -> int:
    """Carry-less multiply reduced by x^8 + x^4 + x^3 + x^2 + 1 (0x11D), bit by bit."""
    out = 0
    while b:
        if b & 1:
            out ^= a
        b >>= 1
        a <<= 1
        if a & 0x100:
            a ^= 0x11D
    return out


def test_mul_table_matches_reference() -> None:
    ref = np.array([[slow_mul(a, b) for b in range(256)] for a in range(256)], dtype=np.uint8)
    assert np.array_equal(gf256.MUL, ref)
    assert gf256.gmul(0x80, 2) == 0x1D      # x^7 * x = x^8 = x^4 + x^3 + x^2 + 1
    assert gf256.gmul(0x53, 0xCA) == slow_mul(0x53, 0xCA)


def test_field_axioms() -> None:
    mul = gf256.MUL.astype(np.int64)
    x = np.arange(256)
    assert np.array_equal(mul, mul.T)                           # commutative
    assert np.array_equal(mul[1], x) and not mul[0].any()       # identity, zero
    # distributive over XOR, for every a, b, c
    lhs = mul[:, x[:, None] ^ x[None, :]]
    rhs = mul[:, :, None] ^ mul[:, None, :]
    assert np.array_equal(lhs, rhs)
    # associative on samples
    rng = np.random.default_rng(1)
    a, b, c = rng.integers(0, 256, (3, 5000))
    assert np.array_equal(mul[mul[a, b], c], mul[a, mul[b, c]])
    # no zero divisors: every non-zero row is a permutation of 0..255
    for row in mul[1:]:
        assert np.array_equal(np.sort(row), x)


def test_inverse() -> None:
    for a in range(1, 256):
        inv = gf256.ginv(a)
        assert gf256.gmul(a, inv) == 1 == slow_mul(a, inv)
    with pytest.raises(ZeroDivisionError):
        gf256.ginv(0)


@pytest.mark.parametrize("c", [0, 1, 2, 0x1D, 0xFF])
def test_scale_into(c: int) -> None:
    v = np.random.default_rng(c).integers(0, 256, 1000, dtype=np.uint8)
    out = np.full(1000, 7, dtype=np.uint8)
    assert gf256.scale_into(out, c, v) is out
    assert out.tolist() == [slow_mul(c, int(b)) for b in v]


def matmul(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    out = []
    for row in a:
        line = []
        for j in range(len(b[0])):
            acc = 0
            for t, x in enumerate(row):
                acc ^= slow_mul(x, b[t][j])
            line.append(acc)
        out.append(line)
    return out


def identity(n: int) -> list[list[int]]:
    return [[int(i == j) for j in range(n)] for i in range(n)]


def test_invert_random_invertible_matrices() -> None:
    rng = random.Random(7)
    for n in range(1, 8):
        for _ in range(15):
            # L (unit lower) * U (non-zero diagonal) is invertible; then shuffle rows
            lower = [[int(i == j) if j >= i else rng.randrange(256) for j in range(n)]
                     for i in range(n)]
            upper = [[rng.randrange(1, 256) if i == j else (rng.randrange(256) if j > i else 0)
                      for j in range(n)] for i in range(n)]
            m = matmul(lower, upper)
            rng.shuffle(m)
            before = [list(r) for r in m]
            inv = gf256.invert(m)
            assert m == before                      # input not modified
            assert matmul(m, inv) == identity(n)
            assert matmul(inv, m) == identity(n)


@pytest.mark.parametrize("matrix", [
    [[0]],
    [[1, 2], [1, 2]],
    [[3, 5], [gf256.gmul(7, 3), gf256.gmul(7, 5)]],         # row 2 = 7 * row 1
    [[1, 2, 3], [0, 0, 0], [4, 5, 6]],
    [[1, 2, 3], [4, 5, 6], [1 ^ 4, 2 ^ 5, 3 ^ 6]],           # row 3 = row 1 + row 2
])
def test_invert_singular(matrix: list[list[int]]) -> None:
    with pytest.raises(ValueError, match="singular"):
        gf256.invert(matrix)


def test_cauchy_generator_is_mds() -> None:
    """Every m x m sub-matrix of [I_m; C] (k rows) is invertible, for k <= 8."""
    for k in range(2, 9):
        for p in range(1, k):
            m = k - p
            c = gf256.cauchy(p, m)
            assert len(c) == p and all(len(r) == m for r in c)
            assert all(x for r in c for x in r)
            gen = identity(m) + c
            for rows in itertools.combinations(range(k), m):
                sub = [gen[r] for r in rows]
                assert matmul(sub, gf256.invert(sub)) == identity(m), (k, p, rows)


def test_cauchy_too_large() -> None:
    with pytest.raises(ValueError):
        gf256.cauchy(200, 57)
    assert len(gf256.cauchy(128, 128)) == 128


# ---------------------------------------------------------------------------- layout
@pytest.mark.parametrize("k,p", SHAPES + [(8, 3), (10, 4)])
def test_layout(k: int, p: int) -> None:
    lay = Layout(k, p)
    m = k - p
    assert lay.m == m
    assert lay.coef == ([[1] * m] if p == 1 else gf256.cauchy(p, m))
    for t in range(k):
        hold, dm = lay.holders(t), lay.data_members(t)
        assert len(hold) == p == len(set(hold)) and len(dm) == m
        assert sorted(hold + dm) == list(range(k))
        assert dm == sorted(dm)
        for j, h in enumerate(hold):
            assert lay.parity_slot(h, t) == j
    for member in range(k):
        as_holder = [t for t in range(k) if member in lay.holders(t)]
        as_data = [t for t in range(k) if member in lay.data_members(t)]
        assert len(as_holder) == p and len(as_data) == m
        assert sorted(lay.parity_slot(member, t) for t in as_holder) == list(range(p))
        for j in range(p):       # slot j of member h is stripe (h - j) % k
            assert lay.parity_slot(member, (member - j) % k) == j
        assert [lay.seg_index(member, t) for t in as_data] == list(range(m))


@pytest.mark.parametrize("k,p", [(1, 1), (3, 0), (3, 3), (4, 5)])
def test_layout_rejects_bad_parity(k: int, p: int) -> None:
    with pytest.raises(ValueError, match=f"{k} members cannot have {p} parity"):
        Layout(k, p)


def test_segments_and_size() -> None:
    assert segment_size([], 3) == ALIGN
    assert segment_size([0, 0], 2) == ALIGN
    assert segment_size([1000, 10], 3) == 384      # ceil(1000/3) = 334 -> 6 * 64
    data = np.arange(1000, dtype=np.int64).astype(np.uint8)
    segs = segments(data, 3, 384)
    assert [len(s) for s in segs] == [384, 384, 1000 - 768]        # views, the last short
    assert all(np.shares_memory(s, data) for s in segs)
    assert np.array_equal(np.concatenate(segs), data)
    tail = piece_of(segs[2], 200, 64)                   # past the shard's end: zeros
    assert len(tail) == 64 and np.array_equal(tail[:32], data[968:]) and not tail[32:].any()
    assert np.shares_memory(piece_of(segs[1], 10, 20), data)     # a whole piece: a view
    short = segments(np.ones(5, np.uint8), 3, 64)
    assert [len(s) for s in short] == [5, 0, 0]
    assert piece_of(short[0], 0, 64)[:5].all() and not piece_of(short[0], 0, 64)[5:].any()
    assert not piece_of(short[2], 0, 64).any()


# ---------------------------------------------------------------------------- simulation
def scaled(c: int, seg: np.ndarray) -> np.ndarray:
    return seg if c == 1 else gf256.scale_into(np.empty(len(seg), np.uint8), c, seg)


def encode(lay: Layout, shards: list[np.ndarray]
           ) -> tuple[int, list[list[np.ndarray]], list[list[np.ndarray]]]:
    """(s, segs[member], parity[member][slot]) as ErasureLevel.encode computes them."""
    s = segment_size([len(d) for d in shards], lay.m)
    segs = [[piece_of(g, 0, s) for g in segments(d, lay.m, s)] for d in shards]
    parity = [[np.zeros(s, np.uint8) for _ in range(lay.p)] for _ in range(lay.k)]
    for t in range(lay.k):
        dm = lay.data_members(t)
        for j, holder in enumerate(lay.holders(t)):
            acc = np.zeros(s, np.uint8)      # Ireduce(BXOR) rooted at the holder
            for me in range(lay.k):
                if me in dm:
                    c = lay.coef[j][dm.index(me)]
                    acc ^= scaled(c, segs[me][lay.seg_index(me, t)])
            parity[holder][lay.parity_slot(holder, t)] = acc
    return s, segs, parity


def decode(lay: Layout, s: int, lost: list[int], data_ok: list[bool], parity_ok: list[bool],
           segs: list[list[np.ndarray]], parity: list[list[np.ndarray]]
           ) -> dict[int, list[np.ndarray]] | None:
    """Rebuilt data segments of the ``lost`` members as ErasureLevel._decode computes them;
    None when some needed stripe cannot be decoded. Only intact segments are read."""
    out = {me: [np.zeros(s, np.uint8) for _ in range(lay.m)] for me in lost}
    for t in range(lay.k):
        dm, hold = lay.data_members(t), lay.holders(t)
        missing = [x for x, mem in enumerate(dm) if mem in lost]
        if not missing:
            continue
        plan = lay.decode_rows(t, {x for x, mem in enumerate(dm) if data_ok[mem]},
                               {j for j, h in enumerate(hold) if parity_ok[h]})
        if plan is None:
            return None
        chosen, inv = plan
        for x in missing:
            acc = np.zeros(s, np.uint8)      # Ireduce(BXOR) rooted at the lost member
            for a, (kind, idx) in enumerate(chosen):
                if kind == "d":
                    owner = dm[idx]
                    assert data_ok[owner] and owner not in lost
                    seg = segs[owner][lay.seg_index(owner, t)]
                else:
                    owner = hold[idx]
                    assert parity_ok[owner]
                    seg = parity[owner][lay.parity_slot(owner, t)]
                acc ^= scaled(inv[x][a], seg)
            target = dm[x]
            out[target][lay.seg_index(target, t)] = acc
    return out


def random_shards(rng: np.random.Generator, k: int) -> list[np.ndarray]:
    lengths = [int(n) for n in rng.integers(0, 700, k)]
    lengths[int(rng.integers(k))] = int(rng.integers(1, 700))     # at least one non-empty
    if k > 2:
        lengths[int(rng.integers(k))] = 0                          # an empty shard
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in lengths]


def assert_rebuilt(shards: list[np.ndarray], out: dict[int, list[np.ndarray]]) -> None:
    for me, segs in out.items():
        rebuilt = np.concatenate(segs)[:len(shards[me])]
        assert rebuilt.tobytes() == shards[me].tobytes(), f"member {me}"


def stripe_solvable(lay: Layout, lost: list[int], data_ok: list[bool], parity_ok: list[bool]
                    ) -> bool:
    """Independent criterion (MDS): each stripe with lost data keeps >= m intact segments."""
    k, p = lay.k, lay.p
    for t in range(k):
        hold = {(t + j) % k for j in range(p)}
        data = [mem for mem in range(k) if mem not in hold]
        if not any(mem in lost for mem in data):
            continue
        if sum(data_ok[mem] for mem in data) + sum(parity_ok[h] for h in hold) < k - p:
            return False
    return True


@pytest.mark.parametrize("k,p", SHAPES)
def test_parity_storage(k: int, p: int) -> None:
    lay = Layout(k, p)
    shards = random_shards(np.random.default_rng(k * 10 + p), k)
    s, segs, parity = encode(lay, shards)
    assert s % ALIGN == 0 and s * lay.m >= max(len(d) for d in shards)
    assert all(len(slots) == p and all(len(x) == s for x in slots) for slots in parity)
    if p == 1:        # plain XOR (RAID-5): parity of stripe t = XOR of its data segments
        for t in range(k):
            want = np.zeros(s, np.uint8)
            for mem in lay.data_members(t):
                want ^= segs[mem][lay.seg_index(mem, t)]
            assert np.array_equal(parity[t][0], want)


@pytest.mark.parametrize("k,p", SHAPES)
def test_every_loss_of_up_to_p_members_is_rebuilt(k: int, p: int) -> None:
    lay = Layout(k, p)
    rng = np.random.default_rng(1000 + k * 10 + p)
    shards = random_shards(rng, k)
    s, segs, parity = encode(lay, shards)
    patterns = 0
    for n in range(1, p + 1):
        for lost in itertools.combinations(range(k), n):
            ok = [i not in lost for i in range(k)]
            out = decode(lay, s, list(lost), ok, ok, segs, parity)
            assert out is not None, lost
            assert_rebuilt(shards, out)
            patterns += 1
    assert patterns == sum(len(list(itertools.combinations(range(k), n)))
                           for n in range(1, p + 1))


@pytest.mark.parametrize("k,p", SHAPES)
def test_losing_p_plus_one_members_is_undecodable(k: int, p: int) -> None:
    if p + 1 > k:
        pytest.skip("cannot lose more than k")
    lay = Layout(k, p)
    for lost in itertools.combinations(range(k), p + 1):
        ok = [i not in lost for i in range(k)]
        results = [lay.decode_rows(t, {x for x, mem in enumerate(lay.data_members(t)) if ok[mem]},
                                   {j for j, h in enumerate(lay.holders(t)) if ok[h]})
                   for t in range(k)]
        # every stripe loses p + 1 of its k segments, at least one of them data
        assert all(r is None for r in results), lost
        assert not stripe_solvable(lay, list(lost), ok, ok)


@pytest.mark.parametrize("k,p", SHAPES)
def test_lost_data_with_damaged_parity_elsewhere(k: int, p: int) -> None:
    """Own shards and parity files fail independently: decoding works exactly when every
    needed stripe keeps m intact segments, and is then bit-exact."""
    lay = Layout(k, p)
    rng = np.random.default_rng(2000 + k * 10 + p)
    shards = random_shards(rng, k)
    s, segs, parity = encode(lay, shards)
    seen = {True: 0, False: 0}
    for data_bits in range(1, 2 ** k):
        lost = [i for i in range(k) if data_bits >> i & 1]
        if len(lost) > p:
            continue
        for parity_bits in range(2 ** k):
            data_ok = [i not in lost for i in range(k)]
            parity_ok = [not parity_bits >> i & 1 for i in range(k)]
            out = decode(lay, s, lost, data_ok, parity_ok, segs, parity)
            want = stripe_solvable(lay, lost, data_ok, parity_ok)
            assert (out is not None) == want, (lost, parity_ok)
            if out is not None:
                assert_rebuilt(shards, out)
            seen[want] += 1
    assert seen[True] and seen[False]


@pytest.mark.parametrize("k,p", [(8, 1), (8, 3), (10, 4), (12, 6)])
def test_random_losses_bigger_sets(k: int, p: int) -> None:
    lay = Layout(k, p)
    rng = np.random.default_rng(k * 100 + p)
    pick = random.Random(k * 100 + p)
    shards = random_shards(rng, k)
    s, segs, parity = encode(lay, shards)
    for _ in range(12):
        lost = sorted(pick.sample(range(k), pick.randint(1, p)))
        ok = [i not in lost for i in range(k)]
        out = decode(lay, s, lost, ok, ok, segs, parity)
        assert out is not None, lost
        assert_rebuilt(shards, out)
    lost = sorted(pick.sample(range(k), p + 1))
    ok = [i not in lost for i in range(k)]
    assert decode(lay, s, lost, ok, ok, segs, parity) is None


def test_decode_rows_prefers_data_and_returns_inverse() -> None:
    lay = Layout(5, 2)
    chosen, inv = lay.decode_rows(0, {0, 2}, {0, 1})  # type: ignore[misc]
    assert chosen == [("d", 0), ("d", 2), ("p", 0)]
    rows = [[1, 0, 0], [0, 0, 1], lay.coef[0]]
    assert matmul(inv, rows) == identity(3)
    assert lay.decode_rows(0, {1}, {1}) is None
    # nothing lost in a stripe: the identity
    chosen, inv = lay.decode_rows(1, {0, 1, 2}, set())  # type: ignore[misc]
    assert chosen == [("d", 0), ("d", 1), ("d", 2)] and inv == identity(3)


@pytest.mark.parametrize("m", [1, 3])
def test_scan_verifies_and_folds_a_shard_in_one_pass(tmp_path, m: int) -> None:
    """``scan`` gives the whole-file checksum and each segment's fold exactly as the
    separate passes did (``checksum``, ``fold(segments(...))``), reads the bytes once, and
    refuses a shard with a flipped tensor byte, naming the file, rank, step and the damage."""
    from ftkit import passes
    from ftkit.capture.flatten import TensorLeaf
    from ftkit.errors import CorruptCheckpointError
    from ftkit.storage.redundancy.erasure import fold, scan
    from ftkit.storage.redundancy.transfer import StreamCheck
    from ftkit.storage.shard import checksum, write_shard

    rng = np.random.default_rng(m)
    sizes = (1_000_003, 5, 0, 300_001)                # odd sizes: an unaligned tail
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    leaves = [TensorLeaf(f"t/{i}", "numpy", "|u1", (n,), n) for i, n in enumerate(sizes)]
    path = tmp_path / "rank-1.ftk"
    write_shard(path, {"job": "u", "step": 4, "rank": 1, "world": 2}, None, leaves, bufs)
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8).copy()
    s = segment_size([len(data) + 4096], m)          # another member's shard is longer

    def check() -> StreamCheck:
        return StreamCheck(path, len(data), source=1, rank=1, step=4, world=None,
                           level="local", damage="damaged after it was written")
    before = passes.snapshot()
    whole, folds = scan(data, m, s, check())
    assert passes.passes(passes.since(before), len(data))["total"] < 1.01
    assert whole == checksum(data)
    assert folds == [fold(piece_of(seg, 0, s)).tobytes() for seg in segments(data, m, s)]
    data[len(data) // 2] ^= 1                         # inside tensor t/0
    with pytest.raises(CorruptCheckpointError, match="damaged after it was written") as info:
        scan(data, m, s, check())
    assert "rank-1.ftk" in str(info.value) and "step 4" in str(info.value)
