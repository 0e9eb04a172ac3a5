"""ftkit.storage.shard against hostile ``.ftk`` files: crafted headers with a *consistent*
header checksum (so only validation can refuse them), truncations and random mutations.

Every refusal must be a CorruptCheckpointError naming the file (and the rank and step the
caller expected); no other exception may escape ``Shard.open`` / ``Shard.parse``; and a
shard that passes ``open`` + ``verify`` must decode (``leaf_from_bytes`` + ``unflatten``)
without any exception.
"""
from __future__ import annotations

import copy
import json
import random
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from ftkit.capture.flatten import flatten, leaf_from_bytes, unflatten
from ftkit.capture.slices import kept_leaves
from ftkit.capture.staging import Stager
from ftkit.errors import CorruptCheckpointError
from ftkit.storage.shard import (
    ALIGN,
    MAGIC,
    SHARED,
    VERSION,
    Shard,
    leaves_of,
    tree_leaves,
    write_shard,
)

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support:UserWarning")

META = {"job": "unit", "step": 7, "rank": 2, "world": 4}
ROOM = 8192      # a "note" this long in the valid header leaves room for crafted ones


def _state() -> dict[str, Any]:
    return {"w": torch.arange(40, dtype=torch.float32).reshape(8, 5),
            "b": torch.ones(3, dtype=torch.bfloat16),
            "np": np.arange(5, dtype=np.int16),
            "s": np.float32(2.5),
            "meta": {"epoch": 3, "lr": 0.1, 1: None, "tags": ["a", ("b", None)]}}


def _valid(tmp_path: Path, room: int = ROOM) -> bytes:
    tree, leaves = flatten(_state())
    path = tmp_path / "valid.ftk"
    meta = {**META, "note": "x" * room} if room else META
    write_shard(path, meta, tree, leaves, Stager().capture(leaves))
    return path.read_bytes()


def _hlen(data: bytes) -> int:
    return int(struct.unpack_from("<I", data, 12)[0])


def _header(data: bytes) -> dict[str, Any]:
    return json.loads(data[24:24 + _hlen(data)])


def _craft(data: bytes, head: bytes) -> bytes:
    """``data`` with its header replaced by ``head`` and a matching header checksum. A
    shorter header is padded with spaces (valid JSON) so tensor offsets stay where they were."""
    hlen = _hlen(data)
    if len(head) < hlen:
        head += b" " * (hlen - len(head))
    return struct.pack("<8sIIQ", MAGIC, VERSION, len(head),
                       xxhash.xxh3_64_intdigest(head)) + head + data[24 + hlen:]


def _dump(header: Any) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


def _decode(shard: Shard) -> Any:
    tensors = [leaf_from_bytes(leaf, shard.raw(i).copy())
               for i, leaf in enumerate(leaves_of(shard.header))]
    return unflatten(shard.header["tree"], tensors)


def _node(tree: dict[str, Any], key: str) -> dict[str, Any]:
    """The skeleton node of top-level key ``key``."""
    return next(node for k, node in tree["items"] if k == key)


def _set(where: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation that sets ``header[where]`` (``tensors.<i>.<key>`` or a top-level key)."""
    def mutate(h: dict[str, Any]) -> None:
        parts = where.split(".")
        if len(parts) == 3:
            h["tensors"][int(parts[1])][parts[2]] = value
        else:
            h[where] = value
    return mutate


def _tree(key: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(h: dict[str, Any]) -> None:
        _node(h["tree"], key).update(fields)
    return mutate


def _off(i: int, delta: int) -> Callable[[dict[str, Any]], None]:
    def mutate(h: dict[str, Any]) -> None:
        h["tensors"][i]["offset"] += delta
    return mutate


def _overlap(h: dict[str, Any]) -> None:
    h["tensors"][1]["offset"] = h["tensors"][0]["offset"] + ALIGN    # w is 160 bytes long


def _same_offset(h: dict[str, Any]) -> None:
    h["tensors"][1]["offset"] = h["tensors"][0]["offset"]


def _past_end(h: dict[str, Any]) -> None:
    h["tensors"][3]["offset"] += 10 * ALIGN


def _drop_key(key: str) -> Callable[[dict[str, Any]], None]:
    def mutate(h: dict[str, Any]) -> None:
        h["tree"]["items"] = [kv for kv in h["tree"]["items"] if kv[0] != key]
    return mutate


def _extra_tensor(h: dict[str, Any]) -> None:
    h["tensors"].append(dict(h["tensors"][2]))          # never referenced by the tree


def _deep_tree(levels: int) -> Callable[[dict[str, Any]], None]:
    def mutate(h: dict[str, Any]) -> None:
        node: dict[str, Any] = {"t": "v", "v": 1}
        for _ in range(levels):
            node = {"t": "list", "items": [node]}
        h["tree"]["items"].append(["deep", node])
    return mutate


def _replace_tree(value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(h: dict[str, Any]) -> None:
        h["tree"] = value
    return mutate


def _item(key: Any, node: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(h: dict[str, Any]) -> None:
        h["tree"]["items"].append([key, node])
    return mutate


BIG = 10 ** 30
MUTATIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    # offsets
    "offset-huge": _set("tensors.0.offset", BIG),
    "offset-2**64": _set("tensors.0.offset", 2 ** 64),
    "offset-negative": _set("tensors.0.offset", -64),
    "offset-zero": _set("tensors.0.offset", 0),
    "offset-in-header": _set("tensors.0.offset", 128),
    "offset-misaligned": _off(0, 1),
    "offset-past-end": _past_end,
    "offset-float": lambda h: _set("tensors.0.offset", float(h["tensors"][0]["offset"]))(h),
    "offset-string": lambda h: _set("tensors.0.offset", str(h["tensors"][0]["offset"]))(h),
    "offset-bool": _set("tensors.0.offset", True),
    "offset-null": _set("tensors.0.offset", None),
    "offset-missing": lambda h: h["tensors"][0].pop("offset"),
    "overlap-partial": _overlap,
    "overlap-same-offset": _same_offset,
    # sizes and shapes
    "nbytes-negative": _set("tensors.2.nbytes", -1),
    "nbytes-plus-one": lambda h: _set("tensors.2.nbytes", h["tensors"][2]["nbytes"] + 1)(h),
    "nbytes-huge": _set("tensors.2.nbytes", 2 ** 62),
    "nbytes-bool": _set("tensors.3.nbytes", True),
    "shape-negative": _set("tensors.0.shape", [-8, -5]),
    "shape-huge": _set("tensors.0.shape", [2 ** 70]),
    "shape-huge-times-zero": _set("tensors.0.shape", [0, 2 ** 70]),
    "shape-float": _set("tensors.0.shape", [8.0, 5.0]),
    "shape-bool": _set("tensors.2.shape", [True, 5]),
    "shape-not-list": _set("tensors.0.shape", 40),
    "shape-nested": _set("tensors.0.shape", [[8], 5]),
    "shape-mismatch": _set("tensors.0.shape", [5, 5]),
    "shape-too-many-dims": _set("tensors.0.shape", [1] * 100 + [40]),
    # dtypes and kinds
    "dtype-object": _set("tensors.2.dtype", "|O"),
    "dtype-O": _set("tensors.2.dtype", "O"),
    "dtype-object-name": _set("tensors.2.dtype", "object"),
    "dtype-structured-object": _set("tensors.2.dtype", 'json:[["a", "|O"], ["b", "|O"]]'),
    "dtype-not-canonical": _set("tensors.2.dtype", "i2"),
    "dtype-bad-descr": _set("tensors.2.dtype", "<f3"),
    "dtype-torch-for-numpy": _set("tensors.2.dtype", "int16"),
    "dtype-json-garbage": _set("tensors.2.dtype", "json:{"),
    "dtype-json-not-descr": _set("tensors.2.dtype", "json:[1, 2]"),
    "dtype-json-deep": _set("tensors.2.dtype", "json:" + "[" * 100_000 + "]" * 100_000),
    "dtype-unknown-torch": _set("tensors.0.dtype", "float33"),
    "dtype-quantized": _set("tensors.0.dtype", "qint8"),
    "dtype-torch-attribute": _set("tensors.0.dtype", "Tensor"),
    "dtype-numpy-for-torch": _set("tensors.0.dtype", "<f4"),
    "dtype-int": _set("tensors.0.dtype", 7),
    "kind-unknown": _set("tensors.0.kind", "pickle"),
    "kind-null": _set("tensors.0.kind", None),
    # checksums and paths
    "checksum-unknown": _set("tensors.0.checksum", "md5:0123"),
    "checksum-not-hex": _set("tensors.0.checksum", "xxh3-64:zz"),
    "checksum-int": _set("tensors.0.checksum", 5),
    "path-int": _set("tensors.0.path", 5),
    # the tensor list
    "tensors-not-list": _set("tensors", {"0": 1}),
    "tensor-not-dict": _set("tensors", [1, 2, 3, 4]),
    "tensors-empty": _set("tensors", []),
    "tensor-unreferenced": _extra_tensor,
    # the tree
    "tree-index-out-of-range": _tree("w", i=4),
    "tree-index-negative": _tree("w", i=-1),
    "tree-index-repeated": _tree("b", i=0),
    "tree-index-missing": _drop_key("b"),
    "tree-index-bool": _tree("b", i=True),
    "tree-index-string": _tree("w", i="0"),
    "tree-index-huge": _tree("w", i=BIG),
    "tree-index-float": _tree("w", i=0.0),
    "tree-scalar-on-torch": _tree("w", scalar=True),
    "tree-scalar-on-array": _tree("np", scalar=True),
    "tree-scalar-not-true": _tree("s", scalar=1),
    "tree-unknown-node": _item("x", {"t": "pickle", "v": "cos\nsystem\n"}),
    "tree-node-without-t": _item("x", {"v": 1}),
    "tree-node-extra-key": _tree("w", extra=1),
    "tree-node-not-dict": _item("x", 5),
    "tree-float-bad-hex": _item("x", {"t": "f", "v": "zz"}),
    "tree-float-short": _item("x", {"t": "f", "v": "00"}),
    "tree-float-not-str": _item("x", {"t": "f", "v": 1.5}),
    "tree-value-list": _item("x", {"t": "v", "v": [1, 2]}),
    "tree-value-float": _item("x", {"t": "v", "v": 1.5}),
    "tree-obj-without-v": _item("x", {"t": "obj"}),
    "tree-list-items-not-list": _item("x", {"t": "list", "items": 3}),
    "tree-dict-item-not-pair": _item("x", {"t": "dict", "items": [[1]]}),
    "tree-dict-key-list": _item("x", {"t": "dict", "items": [[[1], {"t": "v", "v": 1}]]}),
    "tree-dict-key-dict": _item("x", {"t": "dict", "items": [[{}, {"t": "v", "v": 1}]]}),
    "tree-duplicate-key": _item("meta", {"t": "v", "v": 1}),
    "tree-deep-150": _deep_tree(150),
    "tree-int": _replace_tree(5),
    "tree-list": _replace_tree([]),
    "tree-missing": lambda h: h.pop("tree"),
    # identity and format
    "rank-negative": _set("rank", -1),
    "rank-huge": _set("rank", 2 ** 70),
    "rank-bool": _set("rank", True),
    "rank-string": _set("rank", "2"),
    "rank-float": _set("rank", 2.0),
    "step-negative": _set("step", -7),
    "step-huge": _set("step", BIG),
    "step-null": _set("step", None),
    "world-zero": _set("world", 0),
    "world-negative": _set("world", -2),
    "world-bool": _set("world", True),
    "world-missing": lambda h: h.pop("world"),
    "format-2": _set("format", 2),
    "format-bool": _set("format", True),
}

RAW: dict[str, Callable[[bytes], bytes]] = {
    "header-not-dict": lambda head: b"[1, 2, 3]",
    "header-deep-100k": lambda head: b"[" * 100_000 + b"]" * 100_000,
    "tree-deep-100k": lambda head: re.sub(
        rb'"tree":', b'"tree":' + b'{"t":"list","items":[' * 100_000 + b"]}" * 100_000
        + b',"old":', head, count=1),
    "huge-int-literal": lambda head: re.sub(rb'"rank":2', b'"rank":' + b"9" * 5000, head,
                                            count=1),
    "float-inf-literal": lambda head: re.sub(rb'"nbytes":(\d+)', rb'"nbytes":1e999', head,
                                             count=1),
    "nan-literal": lambda head: re.sub(rb'"offset":(\d+)', rb'"offset":NaN', head, count=1),
    "not-utf8": lambda head: b"\xff\xfe" + head[2:],
    "not-json": lambda head: b"{" + head[2:],
    "empty-header": lambda head: b"",
}


def _assert_refused(path: Path, data: bytes) -> CorruptCheckpointError:
    """Open ``data`` (written to ``path``) and parse it from memory: CorruptCheckpointError
    naming file, rank and step each time, never anything else, never the catch-all."""
    path.write_bytes(data)
    errors = []
    for how in ("open", "open-expected", "parse"):
        try:
            if how == "open":
                Shard.open(path).close()
            elif how == "open-expected":
                Shard.open(path, rank=2, step=7).close()
            else:
                Shard.parse(data, path, rank=2, step=7).close()
        except CorruptCheckpointError as exc:
            errors.append(exc)
            continue
        pytest.fail(f"{how}: accepted")
    for exc in errors:
        assert str(path) in str(exc), exc
        assert "unexpected" not in str(exc), exc      # validation, not the safety net
        assert "\n" not in str(exc)
    for exc in errors[1:]:
        assert (exc.rank, exc.step) == (2, 7) and "rank 2" in str(exc) and "step 7" in str(exc)
    return errors[0]


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_crafted_header_is_refused(tmp_path: Path, name: str) -> None:
    data = _valid(tmp_path)
    header = _header(data)
    header.pop("note")
    MUTATIONS[name](header)
    _assert_refused(tmp_path / "rank-2.ftk", _craft(data, _dump(header)))


@pytest.mark.parametrize("name", sorted(RAW))
def test_crafted_raw_header_is_refused(tmp_path: Path, name: str) -> None:
    data = _valid(tmp_path)
    head = _dump({k: v for k, v in _header(data).items() if k != "note"})
    _assert_refused(tmp_path / "rank-2.ftk", _craft(data, RAW[name](head)))


def test_claimed_identity_is_named_when_the_caller_expects_none(tmp_path: Path) -> None:
    data = _valid(tmp_path)
    header = _header(data)
    header.pop("note")
    header["tree"] = 5
    exc = _assert_refused(tmp_path / "rank-2.ftk", _craft(data, _dump(header)))
    assert (exc.rank, exc.step) == (2, 7), exc


def test_unmodified_crafted_copy_is_accepted(tmp_path: Path) -> None:
    """The crafting itself (header re-encoded, padded) keeps a valid shard valid."""
    data = _valid(tmp_path)
    header = _header(data)
    header.pop("note")
    path = tmp_path / "rank-2.ftk"
    path.write_bytes(_craft(data, _dump(header)))
    with Shard.open(path, rank=2, step=7) as shard:
        shard.verify()
        out = _decode(shard)
    assert torch.equal(out["w"], _state()["w"]) and out["s"] == np.float32(2.5)


def test_parity_shard_without_tree_is_accepted(tmp_path: Path) -> None:
    """``world: -1`` and ``tree: null`` (XOR/RS parity files) stay readable."""
    from ftkit.capture.flatten import TensorLeaf
    path = tmp_path / "xor-0-1.ftk"
    seg = np.arange(128, dtype=np.uint8)
    write_shard(path, {"job": "unit", "step": 7, "rank": 1, "world": -1, "level": "xor",
                       "seg": 128}, None, [TensorLeaf("parity/0", "numpy", "|u1", (128,), 128)],
                [seg])
    with Shard.open(path, rank=1, step=7) as shard:
        shard.verify()
        assert np.array_equal(shard.raw(0), seg)


def test_rank_shard_without_a_tree_is_refused_by_check(tmp_path: Path) -> None:
    """``tree: null`` is the format of raw tensors (parity); as a rank's shard, which restore
    must load, ``Shard.check`` refuses it."""
    data = _valid(tmp_path)
    header = _header(data)
    header.pop("note")
    header["tree"] = None
    path = tmp_path / "rank-2.ftk"
    path.write_bytes(_craft(data, _dump(header)))
    Shard.open(path, rank=2, step=7).close()
    with pytest.raises(CorruptCheckpointError, match="no state tree") as info:
        Shard.check(path, rank=2, step=7, world=4)
    assert str(path) in str(info.value) and (info.value.rank, info.value.step) == (2, 7)


def test_every_truncation_is_refused(tmp_path: Path) -> None:
    data = _valid(tmp_path, room=0)
    for n in range(len(data)):
        _assert_refused(tmp_path / "rank-2.ftk", data[:n])


# ---------------------------------------------------------------- random fuzzing
def _accepted_decodes(data: bytes, path: Path) -> bool:
    """Parse ``data``; when it is accepted and its checksums hold, it must decode. Returns
    whether it was accepted; any exception other than CorruptCheckpointError fails."""
    try:
        shard = Shard.parse(data, path, rank=2, step=7)
    except CorruptCheckpointError as exc:
        assert "unexpected" not in str(exc), exc
        return False
    try:
        shard.verify()
    except CorruptCheckpointError:
        return True
    _decode(shard)
    return True


_VALUES = [-1, 0, 1, 63, 64, 2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, BIG, True, False, None,
           "1", 1.5, float("inf"), [], {}, [1], "|O", "float32", "<f4"]


def _int_slots(node: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """(container, key) of every scalar in a JSON value."""
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else []
    for key, val in items:
        if isinstance(val, (dict, list)):
            _int_slots(val, out)
        else:
            out.append((node, key))
    return out


def test_random_field_values(tmp_path: Path) -> None:
    """Every scalar of the header, replaced by hostile values (seeded)."""
    data = _valid(tmp_path)
    base = _header(data)
    base.pop("note")
    rng = random.Random(12)
    accepted = 0
    for _ in range(1500):
        header = copy.deepcopy(base)
        slots = _int_slots(header, [])
        for _ in range(rng.choice((1, 1, 2, 3))):
            node, key = rng.choice(slots)
            node[key] = copy.deepcopy(rng.choice(_VALUES))
        accepted += _accepted_decodes(_craft(data, _dump(header)), tmp_path / "f.ftk")
    assert accepted > 0      # some replacements are harmless (paths, values, job)


def test_random_header_bytes(tmp_path: Path) -> None:
    """Random byte edits of the header JSON, header checksum recomputed (seeded)."""
    data = _valid(tmp_path)
    base = _header(data)
    base.pop("note")
    head = bytearray(_dump(base))
    rng = random.Random(7)
    alphabet = b'0123456789-+.eE"[]{},:tfnTxyz \\'
    for _ in range(3000):
        edit = bytearray(head)
        for _ in range(rng.choice((1, 1, 2, 4))):
            pos = rng.randrange(len(edit))
            op = rng.random()
            if op < 0.6:
                edit[pos] = rng.choice(alphabet)
            elif op < 0.8:
                edit.insert(pos, rng.choice(alphabet))
            else:
                del edit[pos]
        _accepted_decodes(_craft(data, bytes(edit)), tmp_path / "f.ftk")


def test_random_bytes_anywhere(tmp_path: Path) -> None:
    """Random bytes flipped anywhere in a small shard, preamble included (seeded)."""
    data = _valid(tmp_path, room=0)
    rng = random.Random(3)
    for _ in range(2000):
        edit = bytearray(data)
        for _ in range(rng.choice((1, 2, 8))):
            edit[rng.randrange(len(edit))] = rng.randrange(256)
        _accepted_decodes(bytes(edit), tmp_path / "f.ftk")


# ------------------------------------------------------------- shards shared by DP replicas
def _valid_shared(tmp_path: Path) -> bytes:
    """Ring position 1 of 3 of a state whose tensors are all replicated but ``np``."""
    tree, leaves = flatten(_state())
    replicated = [i for i, leaf in enumerate(leaves) if leaf.path != "np"]
    out, share = kept_leaves(leaves, replicated, 3, 1)
    path = tmp_path / "shared.ftk"
    write_shard(path, {**META, "share": share, "note": "x" * ROOM}, tree, out,
                Stager().capture(out))
    return path.read_bytes()


def test_a_shared_shard_opens_and_its_tree_indexes_the_whole_state(tmp_path: Path) -> None:
    data = _valid_shared(tmp_path)
    with Shard.open(tmp_path / "shared.ftk", rank=2, step=7) as shard:
        assert shard.header["format"] == SHARED
        got = [(leaf.path, leaf.dtype, leaf.shape) for leaf in tree_leaves(shard.header)]
        assert shard.tensors[0]["path"] == "np"           # the whole one first
    _, leaves = flatten(_state())
    assert got == [(leaf.path, leaf.dtype, leaf.shape) for leaf in leaves]
    assert _header(data)["format"] == SHARED


def _share(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(h: dict[str, Any]) -> None:
        h["share"][key] = value
    return mutate


def _share_item(key: str, i: int, field: Any, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(h: dict[str, Any]) -> None:
        h["share"][key][i][field] = value
    return mutate


SHARED_MUTATIONS: dict[str, Callable[[dict[str, Any]], None]] = {
    "format-1-with-share": _set("format", VERSION),
    "format-2-without-share": lambda h: h.pop("share"),
    "share-not-object": _set("share", [1, 2]),
    "position-past-the-ring": _share("position", 3),
    "parts-zero": _share("parts", 0),
    "parts-huge": _share("parts", 1 << 40),
    "kept-other-slices": _share("kept", [0, 1]),
    "whole-twice": lambda h: h["share"]["whole"].append(h["share"]["whole"][0]),
    "whole-not-int": _share("whole", ["3"]),
    "replicated-index-str": _share_item("replicated", 0, "index", "0"),
    "replicated-dtype-lie": _share_item("replicated", 0, "dtype", "float64"),
    "replicated-shape-bad": _share_item("replicated", 0, "shape", [-1]),
    "replicated-path-int": _share_item("replicated", 0, "path", 7),
    "span-shifted": _share_item("spans", 0, 2, 64),
    "span-slice-other": _share_item("spans", 0, 0, 0),
    "span-missing": lambda h: h["share"]["spans"].pop(),
    "spans-not-list": _share("spans", None),
    "span-entry-not-bytes": _set("tensors.1.dtype", "float32"),
}


@pytest.mark.parametrize("name", sorted(SHARED_MUTATIONS))
def test_crafted_share_table_is_refused(tmp_path: Path, name: str) -> None:
    """Every lie in a shared shard's ``share`` table (or format) is refused by the checks
    themselves (not their safety net), naming the file, rank and step."""
    data = _valid_shared(tmp_path)
    header = _header(data)
    header.pop("note")
    SHARED_MUTATIONS[name](header)
    exc = _assert_refused(tmp_path / "rank-2.ftk", _craft(data, _dump(header)))
    assert "malformed: " not in str(exc), exc
