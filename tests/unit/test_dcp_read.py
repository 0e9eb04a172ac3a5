"""Reading torch DCP directories without trusting them (``ftkit/interop/dcp.py``): the
metadata is unpickled through an allowlist, every record checked, each chunk read with
``weights_only`` and checked against the metadata."""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from ftkit.errors import CorruptCheckpointError
from ftkit.interop import dcp as fdcp

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")


def _save(path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    state = {"model": {"w": torch.randn(3, 4, generator=g),
                       "h": torch.randn(5, generator=g).to(torch.bfloat16)},
             "step": 7}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return {"model.w": state["model"]["w"], "model.h": state["model"]["h"]}


def test_reads_tensors_of_a_dcp_directory(tmp_path: Path) -> None:
    want = _save(tmp_path / "c")
    found = fdcp.read_metadata(tmp_path / "c")
    assert set(found) == set(want)                    # "step" is pickled bytes: skipped
    for fqn, t in found.items():
        assert (t.dtype, t.shape) == (want[fqn].dtype, tuple(want[fqn].shape))
        [piece] = t.pieces
        assert torch.equal(fdcp.read_piece(tmp_path / "c", t, piece), want[fqn])


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch pwned",))


def test_metadata_naming_anything_else_is_refused_uncalled(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    _save(tmp_path / "c")
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(_Evil()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CorruptCheckpointError, match=r"names posix\.system.*nothing called"):
        fdcp.read_metadata(tmp_path / "c")
    assert not (tmp_path / "pwned").exists()


def _rewrite(path: Path, change: object) -> None:
    """Rewrite the metadata of ``path`` after ``change(metadata)`` (trusted, in the test)."""
    md = dcp.FileSystemReader(str(path)).read_metadata()
    change(md)                                                  # type: ignore[operator]
    (path / ".metadata").write_bytes(pickle.dumps(md))


def _records(md: object) -> list[object]:
    return list(md.storage_data.values())                      # type: ignore[attr-defined]


@pytest.mark.parametrize("damage, needle", [
    (lambda md: [setattr(r, "relative_path", "../escape") for r in _records(md)],
     "bad storage record"),
    (lambda md: [setattr(r, "length", r.length + 10 ** 6) for r in _records(md)],
     "-byte file"),
    (lambda md: md.storage_data.clear(), "has no storage record"),
    (lambda md: [setattr(r, "transform_descriptors", ["zstd"]) for r in _records(md)],
     "with transforms"),
])
def test_bad_records_are_named(tmp_path: Path, damage: object, needle: str) -> None:
    _save(tmp_path / "c")
    _rewrite(tmp_path / "c", damage)
    with pytest.raises(CorruptCheckpointError, match=needle) as info:
        fdcp.read_metadata(tmp_path / "c")
    assert str(tmp_path / "c") in str(info.value)


def test_chunks_that_do_not_tile_the_tensor_are_refused(tmp_path: Path) -> None:
    _save(tmp_path / "c")

    def grow(md: object) -> None:
        md.state_dict_metadata["model.w"].size = torch.Size([6, 4])   # type: ignore[attr-defined]
    _rewrite(tmp_path / "c", grow)
    with pytest.raises(CorruptCheckpointError, match="model.w: the saved chunks hold 12 of"):
        fdcp.read_metadata(tmp_path / "c")


def test_a_chunk_that_is_not_what_the_metadata_says_is_refused(tmp_path: Path) -> None:
    _save(tmp_path / "c")

    def lie(md: object) -> None:
        md.state_dict_metadata["model.w"].properties.dtype = torch.float64  # type: ignore
    _rewrite(tmp_path / "c", lie)
    t = fdcp.read_metadata(tmp_path / "c")["model.w"]
    with pytest.raises(CorruptCheckpointError, match="holds torch.float32 .3, 4., the "
                                                      "metadata says torch.float64"):
        fdcp.read_piece(tmp_path / "c", t, t.pieces[0])
    data = tmp_path / "c" / t.pieces[0].file
    blob = bytearray(data.read_bytes())
    blob[t.pieces[0].offset:t.pieces[0].offset + 8] = b"garbage!"
    data.write_bytes(bytes(blob))
    with pytest.raises(CorruptCheckpointError, match="not a tensor record"):
        fdcp.read_piece(tmp_path / "c", t, t.pieces[0])


@pytest.mark.parametrize("content", [b"", b"\x80\x04not a pickle", pickle.dumps({"a": 1})])
def test_foreign_metadata_is_refused(tmp_path: Path, content: bytes) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / ".metadata").write_bytes(content)
    with pytest.raises(CorruptCheckpointError, match="not DCP metadata"):
        fdcp.read_metadata(tmp_path / "c")
