"""The self-describing HDF5 layout of the parallel-file-system level (DESIGN §5).

``step-<s>/node-<id>.h5`` holds ``/rank/<r>/<state path>`` datasets of the ranks of one node;
``step-<s>/ftkit.h5`` is the index: job attributes and external links ``/rank/<r>`` into the
node files, so the whole step is browsable from one file with plain h5py or ``h5dump``.

Every ``/rank/<r>`` group carries the JSON skeleton of the state (``tree``) and identity
attributes; every dataset carries ``checksum`` (xxh3-64 of its raw bytes, the same value as in
the node-local shard), ``ftkit_dtype`` / ``ftkit_kind`` / ``ftkit_index`` (to rebuild the
exact tensor), ``global_shape``, ``shard_offset`` and ``shard_dim`` (-1: not sharded).
dtypes HDF5 has no type for (bfloat16, float8, ...) are stored as raw bytes (``ftkit_raw``).
h5py is imported lazily: importing ftkit never needs it.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from ftkit.errors import CorruptCheckpointError
from ftkit.storage.shard import Shard, checksum, fsync_dir, write_atomic

FORMAT = "ftkit-hdf5-1"
INDEX = "ftkit.h5"
_H5_TORCH = {"float16": "<f2", "float32": "<f4", "float64": "<f8", "int8": "|i1",
             "int16": "<i2", "int32": "<i4", "int64": "<i8", "uint8": "|u1", "bool": "|b1",
             "complex64": "<c8", "complex128": "<c16"}
CHUNK_BYTES = 64 << 20     # contiguous up to this size; larger tensors: ~16 MiB chunks


def _h5py() -> Any:
    import h5py
    return h5py


def _storage_dtype(t: dict[str, Any]) -> np.dtype | None:
    """The numpy dtype HDF5 stores tensor ``t`` as, or None for raw bytes."""
    if t["kind"] == "torch":
        descr = _H5_TORCH.get(t["dtype"])
        return np.dtype(descr) if descr else None
    if t["dtype"].startswith("json:") or t["dtype"][1] in "UOMmV":
        return None
    return np.dtype(t["dtype"])


def dataset_names(tensors: list[dict[str, Any]]) -> list[str]:
    """HDF5 names of a shard's tensors: the state path, or ``_leaf/<i>`` when the path is
    not a valid, unique HDF5 path."""
    names: list[str] = []
    seen: set[str] = set()
    for i, t in enumerate(tensors):
        path = t["path"]
        ok = path and all(part not in ("", ".") for part in path.split("/"))
        prefixes = {"/".join(path.split("/")[:k]) for k in range(1, path.count("/") + 1)}
        if not ok or path in seen or prefixes & seen or any(
                s.startswith(path + "/") for s in seen):
            path = f"_leaf/{i}"
        seen.add(path)
        names.append(path)
    return names


def _chunks(data: np.ndarray) -> tuple[int, ...] | None:
    """Contiguous storage for tensors up to CHUNK_BYTES (h5py's automatic chunks are ~32 KiB,
    which halves write and read speed); beyond that, chunks of ~16 MiB along dimension 0."""
    if data.nbytes <= CHUNK_BYTES or data.ndim == 0 or data.shape[0] == 0:
        return None
    row = max(1, data.nbytes // data.shape[0])
    return (max(1, (16 << 20) // row), *data.shape[1:])


def write_rank_group(h5: Any, shard: Shard, topology: dict[str, Any]) -> None:
    """Write one rank's shard as ``/rank/<r>`` into an open h5py file."""
    h = shard.header
    grp = h5.create_group(f"rank/{h['rank']}")
    for key in ("rank", "step", "world", "job"):
        grp.attrs[key] = h[key]
    grp.attrs["tree"] = json.dumps(h["tree"])
    grp.attrs["topology"] = json.dumps(topology)
    for i, (t, name) in enumerate(zip(h["tensors"], dataset_names(h["tensors"]))):
        raw = shard.raw(i)
        dtype = _storage_dtype(t)
        data = raw if dtype is None else raw.view(dtype).reshape(t["shape"])
        ds = grp.create_dataset(name, data=data, chunks=_chunks(data))
        ds.attrs.update({"checksum": t["checksum"], "ftkit_kind": t["kind"],
                         "ftkit_dtype": t["dtype"], "ftkit_index": i,
                         "ftkit_raw": dtype is None, "ftkit_path": t["path"],
                         "ftkit_shape": list(t["shape"]),
                         "global_shape": list(t["shape"]) or [0], "shard_offset": 0,
                         "shard_dim": -1})


def write_node_file(path: Path, shards: list[Shard], topology: dict[int, dict[str, Any]]
                    ) -> None:
    """Write the node file atomically (temp name, fsync, rename)."""
    h5py = _h5py()
    tmp = path.with_name(f".{path.name}.tmp")
    with h5py.File(tmp, "w") as h5:
        h5.attrs["format"] = FORMAT
        for shard in shards:
            write_rank_group(h5, shard, topology[shard.header["rank"]])
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_index(step_dir: Path, meta: dict[str, Any], rank_files: dict[int, str]) -> None:
    """Write ``ftkit.h5``: job attributes and external links to every rank's group."""
    h5py = _h5py()
    tmp = step_dir / f".{INDEX}.tmp"
    with h5py.File(tmp, "w") as h5:
        h5.attrs.update({"format": FORMAT, "time": time.time(), **meta})
        ranks = h5.create_group("rank")
        for rank, fname in sorted(rank_files.items()):
            ranks[str(rank)] = h5py.ExternalLink(fname, f"/rank/{rank}")
    os.replace(tmp, step_dir / INDEX)
    fsync_dir(step_dir)


def write_commit(step_dir: Path, record: dict[str, Any]) -> None:
    write_atomic(step_dir / "COMMITTED", [json.dumps(record).encode()])


def read_rank(step_dir: Path, rank: int, *, verify: bool = True
              ) -> tuple[dict[str, Any], list[dict[str, Any]], list[np.ndarray]]:
    """Read ``/rank/<r>`` through the index: (group attrs, tensor entries, raw uint8 arrays)
    in leaf order; checksums verified. Raises CorruptCheckpointError naming the file."""
    h5py = _h5py()
    index = step_dir / INDEX
    try:
        with h5py.File(index, "r") as h5:
            grp = h5[f"rank/{rank}"]
            attrs = {k: grp.attrs[k] for k in grp.attrs}
            entries, arrays = [], []
            for ds in datasets(grp):
                a = ds.attrs
                raw = raw_bytes(ds[()])
                entry = {"path": str(a["ftkit_path"]), "kind": str(a["ftkit_kind"]),
                         "dtype": str(a["ftkit_dtype"]), "checksum": str(a["checksum"]),
                         "index": int(a["ftkit_index"]), "name": ds.name,
                         "shape": [int(x) for x in a["ftkit_shape"]], "nbytes": raw.nbytes}
                if verify and checksum(raw) != entry["checksum"]:
                    raise CorruptCheckpointError(f"{index}:{ds.name}", "checksum mismatch",
                                                 rank=rank, level="pfs")
                entries.append(entry)
                arrays.append(raw)
    except (OSError, KeyError) as exc:
        raise CorruptCheckpointError(str(index), f"cannot read rank {rank}: {exc}",
                                     rank=rank, level="pfs") from exc
    order = sorted(range(len(entries)), key=lambda i: entries[i]["index"])
    return attrs, [entries[i] for i in order], [arrays[i] for i in order]


def raw_bytes(a: Any) -> np.ndarray:
    """The bytes of an array read from a dataset, as a flat uint8 array (C order)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def read_index_attrs(step_dir: Path) -> dict[str, Any]:
    """Attributes of ``step_dir/ftkit.h5`` (CorruptCheckpointError when unreadable)."""
    try:
        with _h5py().File(step_dir / INDEX, "r") as h5:
            return {k: h5.attrs[k] for k in h5.attrs}
    except OSError as exc:
        raise CorruptCheckpointError(str(step_dir / INDEX), f"cannot read: {exc}",
                                     level="pfs") from exc


def datasets(grp: Any) -> list[Any]:
    """Every dataset below an h5py group (links followed), in visiting order."""
    out: list[Any] = []
    grp.visititems(lambda _n, obj: out.append(obj) if hasattr(obj, "dtype") else None)
    return out
