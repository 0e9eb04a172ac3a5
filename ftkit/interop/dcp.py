"""Reading a ``torch.distributed.checkpoint`` (DCP) directory without trusting it.

DCP's own reader unpickles the directory's ``.metadata`` with :mod:`pickle`, which runs
whatever a hostile file names. :func:`read_metadata` unpickles it with an allowlist instead:
only DCP's metadata dataclasses, ``torch.Size``, torch dtypes and layouts, and paths can be
named (anything else: :class:`ftkit.errors.CorruptCheckpointError`, nothing called), and the
result is checked before use: every tensor's chunks tile its global shape, every chunk has a
storage record naming a plain file of the directory with a byte range inside it. The tensor
data itself is read with ``torch.load(..., weights_only=True)``, one chunk at a time, and
checked against the chunk's dtype and shape.

Not supported (a clear error): storage transforms (DCP's compression extensions), and
non-tensor entries are skipped (DCP stores them pickled: ``BytesStorageMetadata``).
"""
from __future__ import annotations

import dataclasses
import io
import os
import pickle
from pathlib import Path
from typing import Any

from ftkit.capture.shards import Chunk
from ftkit.errors import CorruptCheckpointError
from ftkit.recovery import boxes

METADATA = ".metadata"
MAX_METADATA_BYTES = 256 << 20
_DCP = "torch.distributed.checkpoint"
_ALLOWED = {(f"{_DCP}.metadata", name) for name in (
    "Metadata", "TensorStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex", "StorageMeta")} | {
    (f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}


class _Unpickler(pickle.Unpickler):
    """Names only what DCP metadata is made of (see the module docstring)."""

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        import torch
        if (module, name) in _ALLOWED or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CorruptCheckpointError(self.where, f"names {module}.{name}, which is not part "
                                     f"of DCP metadata (refused, nothing called)", level="dcp")


@dataclasses.dataclass(frozen=True)
class Piece:
    """One saved chunk of a DCP tensor and where its bytes are."""

    box: Chunk
    file: str                   # a file of the directory
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class DcpTensor:
    """A global tensor of a DCP checkpoint: its torch dtype, shape and saved chunks."""

    fqn: str
    dtype: Any
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


def read_metadata(path: Path) -> dict[str, DcpTensor]:
    """The tensors of DCP directory ``path`` by fully qualified name, checked (see the
    module docstring); CorruptCheckpointError names the file and what is wrong."""
    meta_path = path / METADATA
    where = str(meta_path)
    try:
        size = meta_path.stat().st_size
        if size > MAX_METADATA_BYTES:
            raise CorruptCheckpointError(where, f"{size} bytes of metadata (more than "
                                         f"{MAX_METADATA_BYTES})", level="dcp")
        data = meta_path.read_bytes()
    except OSError as exc:
        raise CorruptCheckpointError(where, f"cannot read the DCP metadata: {exc.strerror}",
                                     level="dcp") from exc
    try:
        md = _Unpickler(data, where).load()
    except CorruptCheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged pickle fails in many ways
        raise CorruptCheckpointError(where, f"not DCP metadata: {type(exc).__name__}: {exc}",
                                     level="dcp") from None
    return _tensors(md, path, where)


def _tensors(md: Any, path: Path, where: str) -> dict[str, DcpTensor]:
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        raise CorruptCheckpointError(where, "not DCP metadata of the file system writer "
                                     f"(a {type(md).__name__})", level="dcp")
    storage = {(k.fqn, tuple(k.offset or ())): v for k, v in md.storage_data.items()
               if isinstance(k, MetadataIndex)}
    out = {}
    for fqn, tmd in md.state_dict_metadata.items():
        if isinstance(tmd, BytesStorageMetadata):
            continue
        if not isinstance(fqn, str) or not isinstance(tmd, TensorStorageMetadata):
            raise CorruptCheckpointError(where, f"entry {fqn!r} is a {type(tmd).__name__}",
                                         level="dcp")
        out[fqn] = _tensor(fqn, tmd, storage, path, where)
    return out


def _tensor(fqn: str, tmd: Any, storage: dict[tuple[str, tuple[int, ...]], Any], path: Path,
            where: str) -> DcpTensor:
    import torch
    shape = tuple(int(n) for n in tmd.size)
    dtype = tmd.properties.dtype
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(where, f"tensor {fqn!r} has dtype {dtype!r}", level="dcp")
    pieces = []
    for c in tmd.chunks:
        box = Chunk(tuple(int(o) for o in c.offsets), tuple(int(n) for n in c.sizes))
        info = storage.get((fqn, box.offsets))
        if info is None:
            raise CorruptCheckpointError(where, f"tensor {fqn!r}: chunk at {list(box.offsets)} "
                                         f"has no storage record", level="dcp")
        pieces.append(_piece(fqn, box, info, path, where))
    try:
        boxes.check_boxes(fqn, [p.box for p in pieces])
        boxes.plan(fqn, boxes.whole(shape),
                   {p.box: [boxes.Source(0, i, 0, p.box)] for i, p in enumerate(pieces)}, 0)
    except ValueError as exc:
        raise CorruptCheckpointError(where, str(exc), level="dcp") from None
    return DcpTensor(fqn, dtype, shape, tuple(pieces))


def _piece(fqn: str, box: Chunk, info: Any, path: Path, where: str) -> Piece:
    name = getattr(info, "relative_path", None)
    offset, length = getattr(info, "offset", None), getattr(info, "length", None)
    if getattr(info, "transform_descriptors", None):
        raise CorruptCheckpointError(where, f"tensor {fqn!r} is stored with transforms "
                                     f"{list(info.transform_descriptors)}, which ftkit does "
                                     f"not read", level="dcp")
    if not (isinstance(name, str) and name and os.path.basename(name) == name
            and name not in (".", "..") and isinstance(offset, int) and isinstance(length, int)
            and offset >= 0 and length > 0):
        raise CorruptCheckpointError(where, f"tensor {fqn!r}: bad storage record {info!r}",
                                     level="dcp")
    try:
        size = (path / name).stat().st_size
    except OSError as exc:
        raise CorruptCheckpointError(str(path / name), f"tensor {fqn!r}: {exc.strerror}",
                                     level="dcp") from None
    if offset + length > size:
        raise CorruptCheckpointError(str(path / name), f"tensor {fqn!r}: bytes {offset}.."
                                     f"{offset + length} of a {size}-byte file", level="dcp")
    return Piece(box, name, offset, length)


def read_piece(path: Path, tensor: DcpTensor, piece: Piece) -> Any:
    """The chunk ``piece`` of ``tensor`` as a CPU tensor (``torch.load`` with
    ``weights_only``), checked against its dtype and shape."""
    import torch
    where = str(path / piece.file)
    try:
        with open(path / piece.file, "rb") as fh:
            fh.seek(piece.offset)
            data = fh.read(piece.length)
        got = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except OSError as exc:
        raise CorruptCheckpointError(where, f"tensor {tensor.fqn!r}: {exc.strerror}",
                                     level="dcp") from exc
    except Exception as exc:  # noqa: BLE001 - torch.load of damaged bytes fails in many ways
        raise CorruptCheckpointError(where, f"tensor {tensor.fqn!r} at {piece.offset}: not a "
                                     f"tensor record ({type(exc).__name__}: {exc})",
                                     level="dcp") from None
    if not isinstance(got, torch.Tensor) or got.dtype != tensor.dtype \
            or tuple(got.shape) != piece.box.sizes:
        what = f"{got.dtype} {list(got.shape)}" if isinstance(got, torch.Tensor) \
            else type(got).__name__
        raise CorruptCheckpointError(where, f"tensor {tensor.fqn!r} at {piece.offset}: holds "
                                     f"{what}, the metadata says {tensor.dtype} "
                                     f"{list(piece.box.sizes)}", level="dcp")
    return got.contiguous()

