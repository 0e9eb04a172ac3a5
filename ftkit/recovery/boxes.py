"""Box arithmetic of resharding: which saved chunks of a global tensor cover the chunks a
rank needs, and copying the elements of one box from a saved tensor's bytes into a new one.

A tensor of a rank is the concatenation, in C order, of *chunks* of its global tensor
(:class:`ftkit.capture.shards.ShardSpec`; an undeclared tensor is one chunk: the whole).
Resharding fills every chunk a rank needs now from the saved chunks that intersect it:
each saved chunk is a :class:`Source` (a rank, a tensor of its group, where the chunk
starts in that tensor), and identical saved chunks (replicas: several DP ranks, or TP ranks
of a replicated tensor) are alternatives of which one is read. Pure, local.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ftkit.capture.shards import Chunk, ShardSpec, first_overlap, whole

__all__ = ["Copy", "Source", "blocks_needed", "byte_span", "check_boxes", "copy", "direct",
           "intersect", "numel", "plan", "whole", "window"]


@dataclasses.dataclass(frozen=True)
class Source:
    """A saved chunk: tensor ``index`` of ``rank``'s group holds ``box`` from element
    ``start`` on."""

    rank: int
    index: int
    start: int
    box: Chunk


@dataclasses.dataclass(frozen=True)
class Copy:
    """Copy the elements of ``inter`` from ``source`` into the target chunk ``box``, which
    starts at element ``start`` of the target tensor."""

    source: Source
    inter: Chunk
    box: Chunk
    start: int


def intersect(a: Chunk, b: Chunk) -> Chunk | None:
    """The elements two boxes of one global tensor share (None when none)."""
    lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets))
    hi = tuple(min(x + s, y + t) for x, s, y, t in zip(a.offsets, a.sizes, b.offsets, b.sizes))
    sizes = tuple(h - low for low, h in zip(lo, hi))
    if any(s <= 0 for s in sizes):
        return None
    return Chunk(lo, sizes)


def check_boxes(name: str, boxes: Sequence[Chunk]) -> None:
    """The distinct saved boxes of one global tensor must not overlap (identical ones are
    replicas and merged before). ValueError naming the tensor."""
    pair = first_overlap(boxes)
    if pair is not None:
        a, b = boxes[pair[0]], boxes[pair[1]]
        raise ValueError(f"{name}: saved chunks at {list(a.offsets)} (sizes {list(a.sizes)}) "
                         f"and {list(b.offsets)} (sizes {list(b.sizes)}) overlap without "
                         f"being equal")


def plan(name: str, target: ShardSpec, saved: dict[Chunk, list[Source]], pick: int
         ) -> list[Copy]:
    """The copies that fill every chunk of ``target`` from the ``saved`` boxes (each with
    its replicas; ``pick`` chooses among them, e.g. this rank's number, to spread the
    reads). ValueError naming the tensor when the saved boxes do not cover a chunk."""
    out: list[Copy] = []
    start = 0
    for box in target.chunks:
        covered = 0
        for saved_box, replicas in saved.items():
            inter = intersect(box, saved_box)
            if inter is None:
                continue
            out.append(Copy(replicas[pick % len(replicas)], inter, box, start))
            covered += inter.numel
        if covered != box.numel:
            raise ValueError(f"{name}: the saved chunks hold {covered} of the {box.numel} "
                             f"elements of the box at {list(box.offsets)} (sizes "
                             f"{list(box.sizes)}) this rank needs")
        start += box.numel
    return out


def direct(copies: list[Copy], target: ShardSpec, source_numel: int) -> bool:
    """Whether ``copies`` are one saved tensor's bytes as they are (a single chunk, equal
    to the target's single chunk): then it is read straight into the destination."""
    if len(copies) != 1 or len(target.chunks) != 1:
        return False
    c = copies[0]
    return c.inter == c.box == c.source.box and c.source.start == 0 \
        and c.source.box.numel == source_numel


def _elements(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """A flat uint8 buffer as one element per item (bytes copied as they are)."""
    kinds = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
    return raw.view(kinds.get(itemsize, np.dtype((np.void, itemsize))))


def _block(flat: np.ndarray, start: int, box: Chunk) -> np.ndarray:
    return flat[start:start + box.numel].reshape(box.sizes)


def window(inter: Chunk, box: Chunk) -> tuple[Any, ...]:
    """Where ``inter`` lies in a block holding ``box`` (``...`` last: a 0-d block stays an
    array view)."""
    return (*(slice(o - b, o - b + n) for o, b, n in zip(inter.offsets, box.offsets,
                                                         inter.sizes)), Ellipsis)


def copy(c: Copy, source: np.ndarray, dest: np.ndarray, itemsize: int) -> None:
    """Copy ``c``'s elements from ``source`` (the saved tensor's bytes) into ``dest`` (the
    target tensor's bytes); both flat uint8."""
    src = _block(_elements(source, itemsize), c.source.start, c.source.box)
    dst = _block(_elements(dest, itemsize), c.start, c.box)
    np.copyto(dst[window(c.inter, c.box)], src[window(c.inter, c.source.box)])


def _flat(index: Sequence[int], sizes: Sequence[int]) -> int:
    """C-order position of ``index`` in a block of ``sizes``."""
    pos = 0
    for i, n in zip(index, sizes):
        pos = pos * n + i
    return pos


def byte_span(c: Copy, itemsize: int) -> tuple[int, int]:
    """The bytes of the saved tensor between the first and the last element ``c`` reads
    (all of them when the copy takes whole rows of a C-order box; a superset otherwise)."""
    box, inter = c.source.box, c.inter
    first = _flat([o - b for o, b in zip(inter.offsets, box.offsets)], box.sizes)
    last = _flat([o + n - 1 - b for o, n, b in zip(inter.offsets, inter.sizes, box.offsets)],
                 box.sizes)
    return (c.source.start + first) * itemsize, (c.source.start + last + 1) * itemsize


def blocks_needed(spans: Sequence[tuple[int, int]], block: int, nbytes: int
                  ) -> list[int] | None:
    """The blocks of ``block`` bytes (of an ``nbytes`` tensor) that hold the byte ``spans``,
    in order; None when that is every block (then the tensor is read whole)."""
    need = sorted({b for lo, hi in spans if hi > lo for b in range(lo // block,
                                                                   (hi - 1) // block + 1)})
    return None if len(need) >= -(-nbytes // block) else need


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)
