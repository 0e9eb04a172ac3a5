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
from typing import Any

import numpy as np

from ftkit.capture.flatten import DecodeError, TensorLeaf, leaf_nbytes, short_repr, torch_dtype

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


def kept_leaves(leaves: Sequence[TensorLeaf], replicated: Sequence[int], parts: int,
                position: int) -> tuple[list[TensorLeaf], dict[str, Any]]:
    """What the replica at ring ``position`` writes of a state's tensor ``leaves`` (tree
    order) whose ``replicated`` ones (indices, tree order) are cut into ``parts`` slices:
    every other leaf whole, in tree order, then each span of the slices it keeps
    (:func:`kept`) as a flat byte tensor — a view of the live tensor's bytes, no copy
    (a tensor that is not contiguous is copied first) — named ``<path>@<first byte>``.
    Also the table that says how to put them back (``share``: ``parts``, ``position``,
    ``kept``; ``whole``: the tree index of each whole entry, in file order; ``replicated``:
    each replicated tensor's index and description; ``spans``: ``[slice, tree index, first
    byte, bytes]`` of each span entry, in file order after the whole ones)."""
    chosen = set(replicated)
    out = [leaf for i, leaf in enumerate(leaves) if i not in chosen]
    spans: list[list[int]] = []
    slices = plan([(i, leaves[i].nbytes) for i in replicated], parts)
    for k in kept(position, parts):
        for span in slices[k].spans:
            out.append(_span_leaf(leaves[span.leaf], span))
            spans.append([k, span.leaf, span.start, span.nbytes])
    share = {"parts": parts, "position": position, "kept": list(kept(position, parts)),
             "whole": [i for i in range(len(leaves)) if i not in chosen],
             "replicated": [{"index": i, "path": leaves[i].path, "kind": leaves[i].kind,
                             "dtype": leaves[i].dtype, "shape": list(leaves[i].shape),
                             "nbytes": leaves[i].nbytes} for i in replicated],
             "spans": spans}
    return out, share


def _span_leaf(leaf: TensorLeaf, span: Span) -> TensorLeaf:
    """Bytes ``span.start ..`` of ``leaf`` as a flat uint8 tensor of the same kind (a view:
    it shares the live tensor's version counter, so a change during staging is seen)."""
    a, b = span.start, span.start + span.nbytes
    if leaf.kind == "torch":
        flat = leaf.source.detach().reshape(-1)
        source = flat.view(torch_dtype("uint8"))[a:b]
        dtype = "uint8"
    else:
        source = np.ascontiguousarray(leaf.source).reshape(-1).view(np.uint8)[a:b]
        dtype = "|u1"
    return TensorLeaf(f"{leaf.path}@{a}", leaf.kind, dtype, (span.nbytes,), span.nbytes,
                      source)


def unshare(share: Any, entries: Sequence[TensorLeaf]
            ) -> tuple[list[TensorLeaf], list[tuple[int, int]]]:
    """Decode the ``share`` table of a shard whose tensor ``entries`` :func:`kept_leaves`
    wrote: the state's tensors in tree order (the whole entries as they are, the replicated
    ones from their descriptions, without bytes) and, per entry, ``(tree index, first
    byte)`` of the bytes it holds. Trusts nothing: DecodeError (naming the table) unless
    the ring position and kept slices agree, the whole and replicated indices are a
    permutation of the tree's tensors, every description is an allowed tensor, and the
    spans are exactly those of the kept slices, each entry a flat byte tensor of its span's
    size."""
    try:
        return _unshare(share, entries)
    except DecodeError:
        raise
    except Exception as exc:  # noqa: BLE001 - any gap in the checks reads as corrupt
        raise DecodeError("share", f"malformed: {type(exc).__name__}: {exc}") from None


def _unshare(share: Any, entries: Sequence[TensorLeaf]
             ) -> tuple[list[TensorLeaf], list[tuple[int, int]]]:
    def bad(why: str) -> DecodeError:
        return DecodeError("share", why)
    if not isinstance(share, dict):
        raise bad("not an object")
    parts, position = share.get("parts"), share.get("position")
    if not (type(parts) is int and type(position) is int and 0 <= position < parts <= 1 << 20):
        raise bad(f"parts {short_repr(parts)}, position {short_repr(position)}")
    if share.get("kept") != list(kept(position, parts)):
        raise bad(f"kept {short_repr(share.get('kept'))} at position {position} of {parts}")
    whole, described = share.get("whole"), share.get("replicated")
    if not (isinstance(whole, list) and isinstance(described, list)):
        raise bad("whole or replicated is not a list")
    index = whole + [d.get("index") if isinstance(d, dict) else None for d in described]
    if sorted(i for i in index if type(i) is int) != list(range(len(index))):
        raise bad("the whole and replicated tensors are not each tensor of the state once")
    if len(entries) < len(whole):
        raise bad(f"{len(whole)} whole tensors, {len(entries)} entries")
    full: list[TensorLeaf | None] = [None] * len(index)
    for j, i in enumerate(whole):
        full[i] = entries[j]
    for d in described:
        path, kind, dtype, shape, nbytes = (d.get(k) for k in
                                           ("path", "kind", "dtype", "shape", "nbytes"))
        if not isinstance(path, str) or leaf_nbytes(kind, dtype, shape) != nbytes:
            raise bad(f"replicated tensor {short_repr(path)}: {short_repr(d)}")
        full[d["index"]] = TensorLeaf(path, kind, dtype, tuple(shape), nbytes)
    leaves = [leaf for leaf in full if leaf is not None]
    replicated = [d["index"] for d in described]
    slices = plan([(i, leaves[i].nbytes) for i in replicated], parts)
    want = [[k, s.leaf, s.start, s.nbytes] for k in kept(position, parts)
            for s in slices[k].spans]
    if share.get("spans") != want or len(entries) != len(whole) + len(want):
        raise bad("the spans are not those of the kept slices")
    for entry, (_, i, a, n) in zip(entries[len(whole):], want):
        if entry.shape != (n,) or entry.dtype not in ("uint8", "|u1"):
            raise bad(f"entry {entry.path} is not {n} flat bytes of {leaves[i].path}")
    return leaves, [(i, 0) for i in whole] + [(i, a) for _, i, a, _ in want]
