"""Slices of the replicated state: what each data-parallel replica keeps of a shared snapshot.

The D data-parallel replicas of one (tp, pp) shard hold the same bytes. Their replicated
tensors (in tree order, each one's bytes in order) form one byte string, cut here into D
*slices* of balanced size whose boundaries fall on multiples of :data:`ALIGN` bytes (a slice
may start or end inside a tensor, even inside an element: the pieces are bytes, put back
together in the same order). The replica at ring position i (:func:`ftkit.comm.placement.
dp_rings`: neighbours on different nodes) keeps slices i and i + 1 (mod D) — 2/D of the
replicated state — so every slice is held by two replicas on two nodes
(:func:`holders`). Pure.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

#: slice boundaries fall on multiples of this many bytes (the shard format's alignment)
ALIGN = 64


@dataclasses.dataclass(frozen=True)
class Span:
    """``nbytes`` bytes of replicated tensor ``leaf`` (its index among the state's tensor
    leaves) from byte ``start`` of it."""

    leaf: int
    start: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Slice:
    """Slice ``index``: bytes ``start .. start + nbytes`` of the replicated state, made of
    ``spans`` in order."""

    index: int
    start: int
    nbytes: int
    spans: tuple[Span, ...]


def plan(replicated: Sequence[tuple[int, int]], parts: int) -> list[Slice]:
    """Cut the replicated tensors ``(leaf index, nbytes)``, in tree order, into ``parts``
    slices: slice k starts at ``total * k / parts`` rounded down to :data:`ALIGN` (so sizes
    differ by less than 2 ALIGN bytes, and a state smaller than ``parts * ALIGN`` leaves some
    empty); empty tensors are in no span. ValueError for ``parts < 1``."""
    if parts < 1:
        raise ValueError(f"a snapshot is cut into at least 1 slice, not {parts}")
    total = sum(n for _, n in replicated)
    bounds = [total * k // parts // ALIGN * ALIGN for k in range(parts)] + [total]
    slices, todo, at = [], list(replicated), 0          # at: global offset of todo[0]
    for k in range(parts):
        lo, hi, spans = bounds[k], bounds[k + 1], []
        while todo and at < hi:
            leaf, n = todo[0]
            a, b = max(lo, at), min(hi, at + n)
            if b > a:
                spans.append(Span(leaf, a - at, b - a))
            if at + n <= hi:
                todo.pop(0)
                at += n
            else:
                break
        slices.append(Slice(k, lo, hi - lo, tuple(spans)))
    return slices


def kept(position: int, parts: int) -> tuple[int, ...]:
    """The slices the replica at ring ``position`` keeps: its own and the next one (one
    slice when ``parts`` is 1)."""
    return tuple(sorted({position % parts, (position + 1) % parts}))


def holders(index: int, parts: int) -> tuple[int, ...]:
    """The ring positions that keep slice ``index``: it and the one before it."""
    return tuple(sorted({index % parts, (index - 1) % parts}))
