"""Stripe layout of an erasure set (pure): which member holds which segment.

A set has ``k`` members and tolerates ``p`` lost members; every member's shard is cut into
``m = k - p`` data segments of ``s`` bytes. There are ``k`` stripes; in stripe ``t`` the
members ``(t + j) % k`` for ``j < p`` hold parity segment ``j`` and the other ``m`` members
contribute one data segment each. So every member holds ``p`` parity segments (slot ``j`` of
its parity file is stripe ``(h - j) % k``): storage ``p / (k - p)`` of a shard, RAID-5 for
``p = 1``. Parity ``j`` of stripe ``t`` is ``sum_x C[j][x] * data_x`` over GF(256), with
``C`` all ones for ``p = 1`` (plain XOR) and a Cauchy matrix otherwise (MDS).
"""
from __future__ import annotations

import dataclasses
from functools import cached_property

import numpy as np

from ftkit.storage.redundancy import gf256


@dataclasses.dataclass(frozen=True)
class Layout:
    k: int
    p: int

    def __post_init__(self) -> None:
        if not 1 <= self.p < self.k:
            raise ValueError(f"erasure set of {self.k} members cannot have {self.p} parity")

    @property
    def m(self) -> int:
        return self.k - self.p

    @cached_property
    def coef(self) -> list[list[int]]:
        """p x m coefficient matrix of the parity rows."""
        return [[1] * self.m] if self.p == 1 else gf256.cauchy(self.p, self.m)

    def holders(self, t: int) -> list[int]:
        """Members holding parity of stripe t, by parity index j."""
        return [(t + j) % self.k for j in range(self.p)]

    def data_members(self, t: int) -> list[int]:
        """Members contributing data to stripe t, by data position."""
        hold = set(self.holders(t))
        return [i for i in range(self.k) if i not in hold]

    def seg_index(self, member: int, t: int) -> int:
        """Which of ``member``'s data segments lies in stripe t."""
        return sum(1 for u in range(t) if member in self.data_members(u))

    def parity_slot(self, holder: int, t: int) -> int:
        """Slot j of ``holder``'s parity file that holds stripe t's parity."""
        return self.holders(t).index(holder)

    def decode_rows(self, t: int, have_data: set[int], have_parity: set[int]
                    ) -> tuple[list[tuple[str, int]], list[list[int]]] | None:
        """For stripe t, choose m available segments and return them with the inverse of
        their generator rows; None when fewer than m are available.

        ``have_data`` holds data positions (0..m-1), ``have_parity`` parity indices.
        Each chosen segment is ("d", pos) or ("p", j); ``inv[x][a]`` rebuilds data x.
        """
        chosen = [("d", x) for x in sorted(have_data)] + [("p", j) for j in sorted(have_parity)]
        chosen = chosen[:self.m]
        if len(chosen) < self.m:
            return None
        rows = [[int(x == c) for c in range(self.m)] if kind == "d" else self.coef[x]
                for kind, x in chosen]
        return chosen, gf256.invert(rows)


def segments(data: np.ndarray, m: int, s: int) -> list[np.ndarray]:
    """The m data segments of a shard, as views: the last ones may be short or empty (the
    bytes past the shard's end are zeros: :func:`piece_of` pads a piece of them)."""
    return [data[q * s:(q + 1) * s] for q in range(m)]


def piece_of(seg: np.ndarray, at: int, n: int) -> np.ndarray:
    """Bytes ``at .. at + n`` of a segment (:func:`segments`): a view, or where the segment
    ends early a zero-padded copy of at most ``n`` bytes (no whole padded segment is ever
    made; pages of zeros never written stay unallocated)."""
    got = seg[at:at + n]
    if len(got) == n:
        return got
    out = np.zeros(n, dtype=np.uint8)
    out[:len(got)] = got
    return out
