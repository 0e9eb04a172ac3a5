"""Box arithmetic of resharding (ftkit.recovery.boxes): intersections, which saved chunks
fill a target, and element copies between flat byte buffers — checked against NumPy slicing
of the whole global tensor."""
from __future__ import annotations

import numpy as np
import pytest

from ftkit.capture.shards import Chunk, make_spec
from ftkit.recovery import boxes
from ftkit.recovery.boxes import Source


def test_intersect() -> None:
    a = Chunk((0, 2), (4, 4))
    assert boxes.intersect(a, Chunk((2, 0), (4, 4))) == Chunk((2, 2), (2, 2))
    assert boxes.intersect(a, Chunk((4, 0), (2, 6))) is None          # touching rows
    assert boxes.intersect(a, Chunk((0, 6), (4, 1))) is None
    assert boxes.intersect(Chunk((), ()), Chunk((), ())) == Chunk((), ())   # a scalar


def _pieces(glob: np.ndarray, spec: object) -> np.ndarray:
    """The flat bytes of the local tensor ``spec`` describes, cut from ``glob``."""
    parts = [glob[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))].reshape(-1)
             for c in spec.chunks]  # type: ignore[attr-defined]
    return np.concatenate(parts).view(np.uint8)


def _saved(name: str, glob: np.ndarray, specs: list[object]
           ) -> tuple[dict[Chunk, list[Source]], dict[int, np.ndarray]]:
    saved: dict[Chunk, list[Source]] = {}
    data = {}
    for rank, spec in enumerate(specs):
        start = 0
        for c in spec.chunks:  # type: ignore[attr-defined]
            saved.setdefault(c, []).append(Source(rank, 0, start, c))
            start += c.numel
        data[rank] = _pieces(glob, spec)
    boxes.check_boxes(name, list(saved))
    return saved, data


def _fill(target: object, saved: dict[Chunk, list[Source]], data: dict[int, np.ndarray],
          itemsize: int, pick: int = 0) -> np.ndarray:
    out = np.zeros(target.numel * itemsize, dtype=np.uint8)  # type: ignore[attr-defined]
    for c in boxes.plan("w", target, saved, pick):  # type: ignore[arg-type]
        boxes.copy(c, data[c.source.rank], out, itemsize)
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.complex128, np.int8])
def test_fused_tp2_to_tp4_and_tp1(dtype: type) -> None:
    """A fused [q; k; v] weight (12 x 3) saved as TP=2 slices of each block, restored as TP=4
    slices and whole: every target equals NumPy's slicing of the global tensor."""
    glob = (np.arange(36).reshape(12, 3) * 7 + 1).astype(dtype)
    itemsize = glob.dtype.itemsize

    def tp_spec(tp: int, t: int) -> object:
        piece = 4 // tp
        return make_spec((12, 3), [((k * 4 + t * piece, 0), (piece, 3)) for k in range(3)])
    saved, data = _saved("qkv", glob, [tp_spec(2, t) for t in range(2)])
    for tp in (4, 1):
        for t in range(tp):
            spec = tp_spec(tp, t)
            assert np.array_equal(_fill(spec, saved, data, itemsize), _pieces(glob, spec))


def test_row_to_column_cut_and_replicas() -> None:
    """Saved as row halves, each held by two DP replicas; a target cut by columns reads
    from both halves, and ``pick`` chooses which replica."""
    glob = np.arange(48, dtype=np.float64).reshape(6, 8)
    rows = [make_spec((6, 8), [((r * 3, 0), (3, 8))]) for r in (0, 1, 0, 1)]   # 2 replicas
    saved, data = _saved("w", glob, rows)
    assert [len(v) for v in saved.values()] == [2, 2]
    target = make_spec((6, 8), [((0, 4), (6, 4))])
    for pick in (0, 1):
        copies = boxes.plan("w", target, saved, pick)
        assert {c.source.rank for c in copies} == ({0, 1} if pick == 0 else {2, 3})
        assert np.array_equal(_fill(target, saved, data, 8, pick), _pieces(glob, target))


def test_uncovered_and_overlapping_are_refused() -> None:
    glob = np.arange(16, dtype=np.float32).reshape(4, 4)
    saved, _ = _saved("w", glob, [make_spec((4, 4), [((0, 0), (2, 4))])])   # rows 2-3 lost
    with pytest.raises(ValueError, match=r"w: the saved chunks hold 8 of the 16 elements"):
        boxes.plan("w", boxes.whole((4, 4)), saved, 0)
    with pytest.raises(ValueError, match="overlap without being equal"):
        boxes.check_boxes("w", [Chunk((0, 0), (3, 4)), Chunk((2, 0), (2, 4))])


def test_direct_only_for_a_whole_saved_tensor() -> None:
    whole = boxes.whole((4, 2))
    src = Source(0, 0, 0, whole.chunks[0])
    same = boxes.plan("w", whole, {whole.chunks[0]: [src]}, 0)
    assert boxes.direct(same, whole, 8)
    half = make_spec((4, 2), [((0, 0), (2, 2))])
    assert not boxes.direct(boxes.plan("w", half, {whole.chunks[0]: [src]}, 0), half, 8)
    fused = Source(0, 0, 4, Chunk((2, 0), (2, 2)))      # second chunk of a 2-chunk tensor
    lower = make_spec((4, 2), [((2, 0), (2, 2))])
    assert not boxes.direct(boxes.plan("w", lower, {fused.box: [fused]}, 0), lower, 8)


def test_scalar_whole() -> None:
    spec = boxes.whole(())
    src = np.array(3.5, dtype=np.float32).reshape(-1).view(np.uint8)
    out = _fill(spec, {spec.chunks[0]: [Source(0, 0, 0, spec.chunks[0])]}, {0: src}, 4)
    assert out.view(np.float32)[0] == 3.5
