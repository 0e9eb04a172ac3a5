"""``shard.layout`` writes exactly what ``json.dumps`` writes for the header's content, with
offsets that start right after the aligned header and follow each other aligned (large
tensors at a page boundary, for ``O_DIRECT`` writes straight from the mapped shard)."""
from __future__ import annotations

import json

import pytest

from ftkit.capture.flatten import TensorLeaf
from ftkit.storage.shard import _PREAMBLE, ALIGN, PAGE, PAGE_MIN, VERSION, layout

LEAVES = [
    TensorLeaf("model/w", "torch", "<f4", (3, 4), 48),
    TensorLeaf('odd "name" \\ with ünïcødé ✓', "numpy", "|u1", (), 1),
    TensorLeaf("empty", "torch", "<f8", (0, 7), 0),
    TensorLeaf("big", "torch", "<f2", (1 << 20, 3000), 6 * (1 << 30)),   # 10-digit offsets
]


@pytest.mark.parametrize("count", [0, 1, 2, 4])
@pytest.mark.parametrize("tree", [None, {"model": {"w": {"$t": 0}}, "list": [1, 2.5, "x"]}])
def test_layout_is_json_dumps_of_the_header(count: int, tree: object) -> None:
    leaves = LEAVES[:count]
    meta = {"job": "j", "run": "ü", "step": 1234567, "rank": 3, "world": 8,
            "topology": {"nodes": [0, 0, 1, 1]}, "time": 1796232892.844629}
    sums = [f"xxh3-64:{i:016x}" for i in range(count)]
    head, offsets = layout(meta, tree, leaves, sums)
    parsed = json.loads(head)
    entries = [{"path": lf.path, "kind": lf.kind, "dtype": lf.dtype, "shape": list(lf.shape),
                "nbytes": lf.nbytes, "checksum": c, "offset": off}
               for lf, c, off in zip(leaves, sums, offsets)]
    assert parsed == {"format": VERSION, **meta, "tree": tree, "tensors": entries}
    assert head == json.dumps(parsed, separators=(",", ":")).encode()
    pos = -(-(_PREAMBLE.size + len(head)) // ALIGN) * ALIGN
    for lf, off in zip(leaves, offsets):
        if lf.nbytes >= PAGE_MIN:
            pos = -(-pos // PAGE) * PAGE
        assert off == pos
        pos = -(-(pos + lf.nbytes) // ALIGN) * ALIGN
