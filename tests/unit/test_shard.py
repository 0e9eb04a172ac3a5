"""ftkit.storage.shard: the .ftk format, its validation, and that it never pickles."""
from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ftkit.capture.flatten import flatten, leaf_from_bytes, unflatten
from ftkit.capture.staging import Stager
from ftkit.errors import CorruptCheckpointError
from ftkit.storage.shard import (
    ALIGN,
    MAGIC,
    VERSION,
    Shard,
    build_header,
    checksum,
    iter_shard_files,
    leaves_of,
    write_shard,
)

META = {"job": "unit", "step": 7, "rank": 2, "world": 4, "topology": {"dp": 2, "tp": 2}}


def _state() -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(37, dtype=torch.float32).reshape(37, 1),
                  "b": torch.ones(3, dtype=torch.bfloat16)},
        "np": np.arange(5, dtype=np.int16),
        "odd": torch.arange(3, dtype=torch.uint8),
        "meta": {"epoch": 3, "name": "run", "lr": 0.1},
    }


def _write(path: Path, state: Any = None, meta: dict[str, Any] | None = None) -> Path:
    tree, leaves = flatten(_state() if state is None else state)
    write_shard(path, META if meta is None else meta, tree, leaves, Stager().capture(leaves))
    return path


@pytest.fixture
def shard_path(tmp_path: Path) -> Path:
    return _write(tmp_path / "rank-2.ftk")


def _read_state(shard: Shard) -> Any:
    tensors = [leaf_from_bytes(leaf, shard.raw(i).copy())
               for i, leaf in enumerate(leaves_of(shard.header))]
    return unflatten(shard.header["tree"], tensors)


def _flip(path: Path, pos: int) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= 0xFF
    path.write_bytes(bytes(data))


# ----------------------------------------------------------------- format
def test_write_open_verify_read(shard_path: Path) -> None:
    size = shard_path.stat().st_size
    with Shard.open(shard_path, rank=2, step=7) as shard:
        shard.verify()
        assert shard.bad_tensors() == []
        h = shard.header
        assert (h["format"], h["job"], h["step"], h["rank"], h["world"]) == (
            VERSION, "unit", 7, 2, 4)
        assert h["topology"] == {"dp": 2, "tp": 2}
        assert [t["path"] for t in shard.tensors] == ["model/w", "model/b", "np", "odd"]
        assert shard.tensors[0]["dtype"] == "float32" and shard.tensors[0]["shape"] == [37, 1]
        assert shard.tensors[2]["kind"] == "numpy" and shard.tensors[2]["dtype"] == "<i2"
        assert all(t["checksum"].startswith("xxh3-64:") for t in shard.tensors)
        out = _read_state(shard)
    assert torch.equal(out["model"]["w"], _state()["model"]["w"])
    assert np.array_equal(out["np"], np.arange(5, dtype=np.int16))
    assert out["meta"] == {"epoch": 3, "name": "run", "lr": 0.1}
    assert size == shard_path.stat().st_size


def test_preamble_layout(shard_path: Path) -> None:
    data = shard_path.read_bytes()
    magic, version, hlen = struct.unpack_from("<8sII", data, 0)
    assert magic == MAGIC == b"FTKSHRD\0"
    assert version == VERSION
    header = json.loads(data[24:24 + hlen])
    assert header["step"] == 7
    assert all(b == 0 for b in data[24 + hlen:header["tensors"][0]["offset"]])


def test_data_offsets_are_aligned_and_disjoint(shard_path: Path) -> None:
    with Shard.open(shard_path) as shard:
        tensors = shard.tensors
        for t in tensors:
            assert t["offset"] % ALIGN == 0
            assert ALIGN == 64
        ends = [t["offset"] + t["nbytes"] for t in tensors]
        assert all(e <= o for e, o in zip(ends, [t["offset"] for t in tensors[1:]]))
        assert ends[-1] == shard_path.stat().st_size
        for i, t in enumerate(tensors):
            assert shard.raw(i).ctypes.data % ALIGN == 0   # the mmap view itself is aligned
            assert checksum(shard.raw(i)) == t["checksum"]


def test_build_header_converges_with_many_tensors() -> None:
    tree, leaves = flatten({f"t{i}": torch.zeros(i % 7) for i in range(300)})
    bufs = Stager().capture(leaves)
    head, offsets = build_header(META, tree, leaves, bufs)
    entries = json.loads(head)["tensors"]
    assert [e["offset"] for e in entries] == offsets
    assert offsets[0] >= 24 + len(head)
    assert all(o % ALIGN == 0 for o in offsets)


def test_empty_state_and_only_json_leaves(tmp_path: Path) -> None:
    path = _write(tmp_path / "s.ftk", state={"a": 1, "b": [None, "x"]})
    with Shard.open(path) as shard:
        shard.verify()
        assert shard.tensors == []
        assert _read_state(shard) == {"a": 1, "b": [None, "x"]}


def test_shard_is_private_and_no_temp_left(shard_path: Path) -> None:
    assert shard_path.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in shard_path.parent.iterdir()) == ["rank-2.ftk"]


def test_rewrite_replaces_atomically(shard_path: Path) -> None:
    _write(shard_path, meta={**META, "step": 8})
    with Shard.open(shard_path, step=8) as shard:
        shard.verify()
    assert list(iter_shard_files(shard_path.parent)) == [shard_path]


def test_iter_shard_files(tmp_path: Path) -> None:
    for name in ("rank-1.ftk", "rank-0.ftk", ".rank-3.ftk.tmp", "COMMITTED"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "dir.ftk").mkdir()
    assert [p.name for p in iter_shard_files(tmp_path)] == ["rank-0.ftk", "rank-1.ftk"]


# --------------------------------------------------------------- truncation
@pytest.mark.parametrize("keep", [0, 1, 8, 23, 24, 25, 60, "header-1", "header",
                                  "data", "last-1"])
def test_truncated_file(shard_path: Path, keep: int | str) -> None:
    data = shard_path.read_bytes()
    hlen = struct.unpack_from("<I", data, 12)[0]
    with Shard.open(shard_path) as shard:
        first_off = shard.tensors[0]["offset"]
    named = {"header-1": 24 + hlen - 1, "header": 24 + hlen, "data": first_off + 3,
             "last-1": len(data) - 1}
    n = keep if isinstance(keep, int) else named[keep]
    assert n < len(data)
    shard_path.write_bytes(data[:n])
    with pytest.raises(CorruptCheckpointError) as info:
        Shard.open(shard_path, rank=2, step=7)
    msg = str(info.value)
    assert str(shard_path) in msg
    assert "truncated" in msg or "header" in msg
    assert info.value.path == str(shard_path)
    assert info.value.rank == 2 and info.value.step == 7 and "rank 2" in msg


def test_truncated_last_tensor_is_named(shard_path: Path) -> None:
    data = shard_path.read_bytes()
    shard_path.write_bytes(data[:-1])
    with pytest.raises(CorruptCheckpointError, match="tensor odd .*truncated"):
        Shard.open(shard_path)


# ------------------------------------------------------------- bit flips
def test_flip_in_each_tensor_names_it(shard_path: Path) -> None:
    original = shard_path.read_bytes()
    with Shard.open(shard_path) as shard:
        tensors = [dict(t) for t in shard.tensors]
    for t in tensors:
        for pos in (t["offset"], t["offset"] + t["nbytes"] // 2, t["offset"] + t["nbytes"] - 1):
            shard_path.write_bytes(original)
            _flip(shard_path, pos)
            with Shard.open(shard_path) as shard:     # header still fine
                assert shard.bad_tensors() == [t["path"]]
                with pytest.raises(CorruptCheckpointError) as info:
                    shard.verify()
            msg = str(info.value)
            assert t["path"] in msg and "checksum" in msg and str(shard_path) in msg
            assert info.value.rank == 2 and info.value.step == 7


def test_many_bad_tensors_are_listed(tmp_path: Path) -> None:
    path = _write(tmp_path / "s.ftk", state={f"t{i}": torch.full((4,), i) for i in range(8)})
    with Shard.open(path) as shard:
        offsets = [t["offset"] for t in shard.tensors]
    for off in offsets:
        _flip(path, off)
    with Shard.open(path) as shard:
        assert len(shard.bad_tensors()) == 8
        with pytest.raises(CorruptCheckpointError, match="8 tensor.*t0, t1, t2, t3, t4 ..."):
            shard.verify()


def test_flip_in_header_is_header_checksum(shard_path: Path) -> None:
    data = shard_path.read_bytes()
    hlen = struct.unpack_from("<I", data, 12)[0]
    for pos in (24, 24 + hlen // 2, 24 + hlen - 1):
        shard_path.write_bytes(data)
        _flip(shard_path, pos)
        with pytest.raises(CorruptCheckpointError, match="header checksum") as info:
            Shard.open(shard_path)
        assert str(shard_path) in str(info.value)


def test_flip_in_header_checksum_field(shard_path: Path) -> None:
    _flip(shard_path, 16)
    with pytest.raises(CorruptCheckpointError, match="header checksum"):
        Shard.open(shard_path)


def test_flip_in_header_length_field(shard_path: Path) -> None:
    _flip(shard_path, 13)
    with pytest.raises(CorruptCheckpointError, match="header"):
        Shard.open(shard_path)


def test_wrong_version(shard_path: Path) -> None:
    data = bytearray(shard_path.read_bytes())
    struct.pack_into("<I", data, 8, VERSION + 1)
    shard_path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=f"version {VERSION + 1}"):
        Shard.open(shard_path)


def test_valid_checksum_but_malformed_header(tmp_path: Path) -> None:
    import xxhash
    head = json.dumps({"format": VERSION, "tensors": []}).encode()   # no tree/rank/step
    path = tmp_path / "x.ftk"
    path.write_bytes(struct.pack("<8sIIQ", MAGIC, VERSION, len(head),
                                 xxhash.xxh3_64_intdigest(head)) + head)
    with pytest.raises(CorruptCheckpointError, match="malformed shard header"):
        Shard.open(path)


# ------------------------------------------------------------ foreign files
def _foreign_random(path: Path) -> None:
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, np.uint8).tobytes())


def _foreign_json(path: Path) -> None:
    path.write_text(json.dumps({"step": 7, "rank": 2, "tensors": [], "padding": "x" * 64}))


def _foreign_torch(path: Path) -> None:
    torch.save({"w": torch.ones(4)}, path)


def _foreign_npy(path: Path) -> None:
    np.save(path, np.arange(100))


def _foreign_text(path: Path) -> None:
    path.write_text("FTKSHRD is not the magic without the NUL byte, this is a text file\n")


@pytest.mark.parametrize("make", [_foreign_random, _foreign_json, _foreign_torch, _foreign_npy,
                                  _foreign_text], ids=lambda f: f.__name__)
def test_foreign_file_is_not_a_shard(tmp_path: Path, make: Any) -> None:
    path = tmp_path / "rank-0.ftk"
    make(path)
    if not path.exists():                          # np.save appends .npy
        path = path.with_name(path.name + ".npy")
    with pytest.raises(CorruptCheckpointError, match="not an ftkit shard") as info:
        Shard.open(path)
    assert str(path) in str(info.value)


def test_short_foreign_file_is_not_a_shard(tmp_path: Path) -> None:
    path = tmp_path / "rank-0.ftk"
    path.write_text('{"a": 1}\n')
    with pytest.raises(CorruptCheckpointError, match="not an ftkit shard"):
        Shard.open(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CorruptCheckpointError, match="cannot read") as info:
        Shard.open(tmp_path / "nope.ftk", rank=1, step=2)
    assert isinstance(info.value.__cause__, OSError)


# ----------------------------------------------------------------- identity
@pytest.mark.parametrize(("kwargs", "what", "have", "want"), [
    ({"rank": 3}, "rank", 2, 3),
    ({"step": 8}, "step", 7, 8),
    ({"rank": 2, "step": 6}, "step", 7, 6),
])
def test_identity_mismatch_on_open(shard_path: Path, kwargs: dict[str, Any], what: str,
                                   have: int, want: int) -> None:
    with pytest.raises(CorruptCheckpointError) as info:
        Shard.open(shard_path, **kwargs)
    assert f"shard has {what} {have}, expected {want}" in str(info.value)


def test_identity_world_mismatch(shard_path: Path) -> None:
    with Shard.open(shard_path) as shard:
        shard.check_identity(rank=2, step=7, world=4)
        with pytest.raises(CorruptCheckpointError, match="world size 4, expected 8"):
            shard.check_identity(rank=2, step=7, world=8)


# --------------------------------------------------------------- no pickle
def test_no_pickle_on_write_or_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle used")

    class NoUnpickler:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("pickle.Unpickler used")

    for name in ("dumps", "dump", "loads", "load"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(pickle, "Unpickler", NoUnpickler)
    monkeypatch.setattr(pickle, "Pickler", NoUnpickler)
    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(torch, "save", forbidden)
    state = {**_state(), "np_scalar": np.float32(2.5), "rec": np.zeros(2, "<i4,<f8")}
    path = _write(tmp_path / "p.ftk", state=state)
    with Shard.open(path) as shard:
        shard.verify()
        out = _read_state(shard)
    assert out["np_scalar"] == np.float32(2.5)
    assert out["rec"].dtype == state["rec"].dtype


def test_header_is_plain_json(shard_path: Path) -> None:
    data = shard_path.read_bytes()
    hlen = struct.unpack_from("<I", data, 12)[0]
    header = json.loads(data[24:24 + hlen].decode("utf-8"))
    assert set(header) >= {"format", "step", "rank", "world", "tree", "tensors"}
