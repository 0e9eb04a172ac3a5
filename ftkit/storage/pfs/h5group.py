"""A rank's group of a PFS step as a reader meets it: :class:`RankGroup`, verified before any
tensor byte is read (seal, identity, hard links only, storage inside the file, every
dataset's attributes against each other and the stored dtype and shape, the tree against the
datasets). The layout it checks is :mod:`ftkit.storage.pfs.hdf5`'s."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ftkit.capture.flatten import itemsize
from ftkit.capture.shards import ShardSpec
from ftkit.errors import CorruptCheckpointError
from ftkit.storage.pfs import h5files, hdf5


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} is {value!r}, not an integer")
    return value


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list):
        raise TypeError(f"{what} is {value!r}, not a list of integers")
    return [_int(v, what) for v in value]


def tensor_entry(name: str, ds: Any, a: dict[str, Any]) -> dict[str, Any]:
    """The validated description of one dataset (plain attrs ``a``): its attributes agree
    with each other and with the stored HDF5 dtype and shape (ValueError/KeyError else)."""
    kind, dtype = a["ftkit_kind"], a["ftkit_dtype"]
    path, digest = a["ftkit_path"], a["checksum"]
    if not all(isinstance(v, str) for v in (kind, dtype, path, digest)):
        raise ValueError("ftkit_kind, ftkit_dtype, ftkit_path and checksum must be strings")
    if not digest.startswith("xxh3-64:"):
        raise ValueError(f"unknown checksum {digest!r}")
    shape = _ints(a["ftkit_shape"], "ftkit_shape")
    if any(n < 0 for n in shape):
        raise ValueError(f"negative dimension in ftkit_shape {shape}")
    nbytes = math.prod(shape) * itemsize(kind, dtype)
    raw = a["ftkit_raw"]
    want = hdf5.storage_dtype({"kind": kind, "dtype": dtype})
    if not isinstance(raw, bool) or raw != (want is None):
        raise ValueError(f"ftkit_raw {raw!r} does not fit {kind} dtype {dtype}")
    stored = (np.dtype(np.uint8), (nbytes,)) if want is None else (want, tuple(shape))
    if ds.shape is None or (ds.dtype, tuple(ds.shape)) != stored:
        raise ValueError(f"stored as {ds.dtype.str} {ds.shape}, but ftkit_dtype {dtype} "
                         f"ftkit_shape {shape} need {stored[0].str} {stored[1]}")
    if ds.size * ds.dtype.itemsize != nbytes:
        raise ValueError(f"holds {ds.size * ds.dtype.itemsize} bytes, ftkit_shape {shape} of "
                         f"{dtype} needs {nbytes}")
    key = a.get("ftkit_key")
    if key is not None and not isinstance(key, str):
        raise ValueError(f"ftkit_key {key!r} is not a string")
    return {"path": path, "kind": kind, "dtype": dtype, "shape": shape, "nbytes": nbytes,
            "checksum": digest, "index": _int(a["ftkit_index"], "ftkit_index"),
            "name": str(ds.name), "dataset_name": name, "shard": shard_of(a, shape),
            "key": key, "blocks": blocks_of(a, nbytes)}


def blocks_of(a: dict[str, Any], nbytes: int) -> tuple[int, list[int]] | None:
    """``(block_bytes, [xxh3-64 of each block])`` of a dataset that records them, else None;
    ValueError/TypeError when the count does not fit the tensor's bytes."""
    sums = a.get("block_checksums")
    if sums is None and "block_bytes" not in a:
        return None
    size = _int(a.get("block_bytes"), "block_bytes")
    if size <= 0 or not isinstance(sums, list) or len(sums) != -(-nbytes // size):
        raise ValueError(f"block_checksums ({_count(sums)}) do not cover {nbytes} bytes in "
                         f"blocks of {size}")
    return size, _ints(sums, "block_checksums")


def _count(value: Any) -> str:
    return f"{len(value)} of them" if isinstance(value, list) else repr(value)[:40]


def shard_of(a: dict[str, Any], shape: list[int]) -> dict[str, Any] | None:
    """Where a dataset (plain attrs ``a``, tensor ``shape``) lies in its global tensor:
    None when it is not a declared shard (``shard_dim`` -1), else ``{"dim", "offset",
    "global_shape", "chunks"}`` (``dim``/``offset`` None for several chunks or dimensions;
    ``chunks``: ``[[offsets], [sizes]]`` each). Files without ``shard_offsets`` describe one
    slice along ``shard_dim``. ValueError/TypeError when the attributes disagree."""
    dim = _int(a["shard_dim"], "shard_dim")
    if dim == -1:
        return None
    gshape = _ints(a["global_shape"], "global_shape")
    offset = _int(a["shard_offset"], "shard_offset")
    if "shard_offsets" in a or "shard_sizes" in a:
        offsets, sizes = a.get("shard_offsets"), a.get("shard_sizes")
        if not (isinstance(offsets, list) and isinstance(sizes, list)
                and len(offsets) == len(sizes)):
            raise ValueError(f"shard_offsets {offsets!r} and shard_sizes {sizes!r} are not "
                             f"lists of one row per chunk")
        chunks = list(zip(offsets, sizes))
    elif dim >= 0 and len(shape) == len(gshape):
        chunks = [([offset if d == dim else 0 for d in range(len(gshape))], shape)]
    else:
        raise ValueError(f"shard_dim {dim} without shard_offsets/shard_sizes")
    spec = ShardSpec.from_json({"global_shape": gshape, "chunks": [list(c) for c in chunks]},
                               math.prod(shape))
    want = -2 if spec.dim is None else spec.dim
    described = spec.to_json()["chunks"]
    if dim != want or (dim >= 0 and offset != spec.chunks[0].offsets[dim]):
        raise ValueError(f"shard_dim {dim} / shard_offset {offset} do not describe chunks "
                         f"{described}")
    return {"dim": spec.dim, "offset": None if spec.dim is None else offset,
            "global_shape": gshape, "chunks": described}


def count_tensors(node: Any) -> int:
    """Tensor leaves of a state skeleton."""
    if isinstance(node, dict):
        return (node.get("t") == "tensor") + sum(count_tensors(v) for v in node.values())
    if isinstance(node, list):
        return sum(count_tensors(v) for v in node)
    return 0


@dataclasses.dataclass
class RankGroup:
    """A verified ``/rank/<r>`` group: attributes, parsed tree and topology, and its tensor
    entries with their datasets in tree order (``ftkit_index``)."""

    file: str
    where: str
    attrs: dict[str, Any]
    tree: Any
    topology: dict[str, Any]
    entries: list[dict[str, Any]]
    datasets: list[Any]

    @classmethod
    def load(cls, grp: Any, file: Path | str, *, rank: int, step: int | None = None,
             world: int | None = None, job: str | None = None,
             file_size: int | None = None) -> RankGroup:
        """Verify ``grp``'s ``meta_checksum`` first, then its identity (rank, step, world,
        job), that everything below it is a plain (hard-linked) group or dataset whose data
        lies inside the file's ``file_size`` bytes (see :func:`h5files.check_storage`), every
        dataset's attributes and the tree against the datasets. Reads no tensor data.
        Raises CorruptCheckpointError naming the file and object."""
        where = f"{file}:{grp.name}"

        def bad(at: str, why: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(at, why, rank=rank, step=step, level="pfs")
        try:
            _only_hard_links(grp)
            canon, items = hdf5.group_canon(grp)
            hdf5.check_seal(grp, canon, where, rank=rank, step=step)
        except CorruptCheckpointError:
            raise
        except Exception as exc:
            raise bad(where, f"unreadable rank group: {hdf5.reason(exc)}") from exc
        attrs = canon["attrs"]
        for key, want in (("rank", rank), ("step", step), ("world", world), ("job", job)):
            if want is not None and attrs.get(key) != want:
                raise bad(where, f"group says {key} {attrs.get(key)!r}, "
                                 f"{'linked as' if key == 'rank' else 'expected'} {want!r}")
        try:
            tree = json.loads(attrs["tree"])
            topology = json.loads(attrs.get("topology", "{}"))
            if not isinstance(topology, dict):
                raise TypeError("topology is not a JSON object")
            expected = count_tensors(tree)
        except (KeyError, TypeError, ValueError, RecursionError) as exc:
            raise bad(where, f"bad 'tree'/'topology' attribute: {hdf5.reason(exc)}") from exc
        entries, datasets = [], []
        for name, ds, a in items:
            try:
                entry = tensor_entry(name, ds, a)
                if file_size is not None:
                    h5files.check_storage(ds, file_size, entry["nbytes"])
            except (KeyError, TypeError, ValueError) as exc:
                raise bad(f"{file}:{ds.name}", f"bad dataset: {hdf5.reason(exc)}") from exc
            entries.append(entry)
            datasets.append(ds)
        order = sorted(range(len(entries)), key=lambda i: entries[i]["index"])
        entries = [entries[i] for i in order]
        datasets = [datasets[i] for i in order]
        have = [e["index"] for e in entries]
        if have != list(range(expected)):
            missing = sorted(set(range(expected)) - set(have))
            raise bad(where, f"its tree has {expected} tensors but it holds {len(have)} "
                             f"datasets" + (f" (missing ftkit_index {missing})" if missing
                                            else f" (ftkit_index {have})"))
        return cls(str(file), where, attrs, tree, topology, entries, datasets)


def _only_hard_links(grp: Any) -> None:
    """Everything below a rank group must be reached by hard links: an external or soft link
    could lead out of the file or to another rank's data (TypeError)."""
    h5py = hdf5._h5py()
    found = grp.visititems_links(lambda name, link: None if isinstance(link, h5py.HardLink)
                                 else (name, type(link).__name__))
    if found is not None:
        raise TypeError(f"{found[0]!r} is a {found[1]}; only plain groups and datasets are "
                        f"allowed in a rank group")
