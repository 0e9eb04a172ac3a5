"""The self-describing HDF5 layout of the parallel-file-system level (docs/formats.md).

``step-<s>/rank-<r>.h5`` holds rank r's ``/rank/<r>/<state path>`` datasets (every rank writes
its own file, in parallel); ``step-<s>/node-<id>.h5`` holds external links ``/rank/<r>`` into the
rank files of one node's ranks (steps written before rank files existed hold the datasets there);
``step-<s>/ftkit.h5`` is the index: job attributes and external links ``/rank/<r>`` into the
node files, so the whole step is browsable from one file with plain h5py or ``h5dump``.

Every ``/rank/<r>`` group carries the JSON skeleton of the state (``tree``) and identity
attributes; every dataset carries ``checksum`` (xxh3-64 of its raw bytes, the same value as in
the node-local shard), ``ftkit_dtype`` / ``ftkit_kind`` / ``ftkit_index`` (to rebuild the
exact tensor), ``global_shape``, ``shard_offset`` and ``shard_dim`` (-1: not sharded).
dtypes HDF5 has no type for (bfloat16, float8, ...) are stored as raw bytes (``ftkit_raw``).

Nothing a reader trusts is unprotected (format ``ftkit-hdf5-2``): every ``/rank/<r>`` group
and the root of every file carry ``meta_checksum``, the xxh3-64 of a canonical JSON form
(sorted keys, compact) of

* a rank group: its attributes, and for every dataset below it its name, stored HDF5 dtype
  and shape and all its attributes;
* a file root: its attributes and the links of ``/rank`` (external link targets in the index).

:class:`ftkit.storage.pfs.h5read.StepReader` (restore) and the ``ftkit`` CLI verify these
before using a value, then
cross-check every dataset (``nbytes == prod(ftkit_shape) * itemsize(ftkit_dtype)`` and the
stored dtype and shape) and the tree against the datasets. Files without the checksum (format
``ftkit-hdf5-1``) are refused. h5py is imported lazily: importing ftkit never needs it.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import xxhash

from ftkit import passes
from ftkit.capture.shards import ShardSpec, header_table
from ftkit.errors import CorruptCheckpointError
from ftkit.fs import create_temp, fsync_dir, rename_into_place, write_atomic
from ftkit.storage.pfs import h5files
from ftkit.storage.pfs.h5sink import H5Sink, write_new_file
from ftkit.storage.shard import PAGE_MIN, XXH3, Shard, checksum


class ShardData(Protocol):
    """What a rank group is written from: a :class:`~ftkit.storage.shard.Shard`, or the
    tentative snapshot an early write reads (:class:`ftkit.storage.pfs.early.LandingShard`).
    ``raw(i)`` may block until tensor ``i`` is there; ``tensors[i]["checksum"]`` holds its
    checksum once ``raw(i)`` returned."""

    path: Path
    header: dict[str, Any]

    @property
    def tensors(self) -> list[dict[str, Any]]: ...

    def raw(self, index: int) -> np.ndarray: ...


FORMAT = "ftkit-hdf5-2"
INDEX = "ftkit.h5"
COMMITTED = "COMMITTED"
META = "meta_checksum"
_H5_TORCH = {"float16": "<f2", "float32": "<f4", "float64": "<f8", "int8": "|i1",
             "int16": "<i2", "int32": "<i4", "int64": "<i8", "uint8": "|u1", "bool": "|b1",
             "complex64": "<c8", "complex128": "<c16"}
RAW_MIN = PAGE_MIN         # tensors from this size on: raw bytes written at their place
RAW_PIECE = 4 << 20        # ... hashed and written in pieces of this size
BLOCK_BYTES = RAW_PIECE    # a rank file's tensor of several pieces also records the xxh3-64
MAX_BLOCKS = 4096          # of each (``block_checksums``), up to this many: a reshard then
#                            reads and checks only the blocks it needs


def _h5py() -> Any:
    import h5py
    return h5py


def storage_dtype(t: dict[str, Any]) -> np.dtype | None:
    """The numpy dtype HDF5 stores tensor ``t`` as, or None for raw bytes."""
    if t["kind"] == "torch":
        descr = _H5_TORCH.get(t["dtype"])
        return np.dtype(descr) if descr else None
    if t["dtype"].startswith("json:") or len(t["dtype"]) < 2 or t["dtype"][1] in "UOMmV":
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


# --------------------------------------------------------------------------- metadata checksum

def _plain(value: Any) -> Any:
    """An attribute value as JSON-able Python that keeps its kind (bytes stay tagged)."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()] if value.ndim else _plain(value.item())
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"repr": f"{type(value).__module__}.{type(value).__qualname__}"}


def attrs_of(obj: Any) -> dict[str, Any]:
    """Every attribute of an h5py object but ``meta_checksum``, as plain Python."""
    return {k: _plain(obj.attrs[k]) for k in obj.attrs if k != META}


def _digest(canon: Any) -> str:
    return checksum(json.dumps(canon, sort_keys=True, separators=(",", ":")).encode())


def _links(grp: Any) -> dict[str, list[str]]:
    h5py = _h5py()
    out: dict[str, list[str]] = {}
    for name in grp:
        link = grp.get(name, getlink=True)
        if isinstance(link, h5py.ExternalLink):
            out[name] = ["external", link.filename, link.path]
        elif isinstance(link, h5py.SoftLink):
            out[name] = ["soft", link.path]
        else:
            out[name] = ["hard"]
    return out


def root_canon(h5: Any) -> dict[str, Any]:
    """Canonical form of a file root: attributes, members, links of ``/rank``."""
    ranks = h5.get("rank", getlink=True)
    return {"attrs": attrs_of(h5), "members": sorted(h5),
            "rank": _links(h5["rank"]) if ranks is not None else None}


def _dataset_list(grp: Any) -> list[tuple[str, Any]]:
    """(name relative to ``grp``, dataset) of every dataset below ``grp``, sorted by name."""
    found: list[tuple[str, Any]] = []
    grp.visititems(lambda n, obj: found.append((n, obj)) if hasattr(obj, "dtype") else None)
    return sorted(found, key=lambda item: item[0])


def group_canon(grp: Any) -> tuple[dict[str, Any], list[tuple[str, Any, dict[str, Any]]]]:
    """(canonical form, [(name, dataset, plain attrs)]) of a rank group, read once."""
    items = [(name, ds, attrs_of(ds)) for name, ds in _dataset_list(grp)]
    canon = {"attrs": attrs_of(grp),
             "datasets": [{"name": name, "dtype": ds.dtype.str,
                           "shape": None if ds.shape is None else list(ds.shape),
                           "attrs": attrs} for name, ds, attrs in items]}
    return canon, items


def seal(obj: Any) -> None:
    """(Re)compute and store ``meta_checksum`` of a file root (``obj`` is the File) or a rank
    group, from what the file holds now."""
    canon = root_canon(obj) if obj.name == "/" else group_canon(obj)[0]
    obj.attrs[META] = _digest(canon)


def check_seal(obj: Any, canon: Any, where: str, *, rank: int | None,
               step: int | None) -> None:
    stored = obj.attrs.get(META)
    who = ", ".join(x for x in (f"rank {rank}" if rank is not None else "",
                               f"step {step}" if step is not None else "") if x)
    if stored is None:
        raise CorruptCheckpointError(where, f"no {META} attribute: its metadata cannot be "
                                            f"trusted", rank=rank, step=step, level="pfs")
    got = _digest(canon)
    if _plain(stored) != got:
        raise CorruptCheckpointError(
            where, f"metadata checksum mismatch{f' ({who})' if who else ''}: stored "
                   f"{_plain(stored)}, attributes and datasets give {got} (changed after "
                   f"writing)", rank=rank, step=step, level="pfs")


def check_root(h5: Any, where: str, *, step: int | None = None) -> dict[str, Any]:
    """Verify a file root (format and ``meta_checksum``); its attributes as plain Python.
    With ``step``, also that an index says that step. Raises CorruptCheckpointError."""
    try:
        fmt = _plain(h5.attrs.get("format"))
        if fmt != FORMAT:
            if fmt is None:
                why = "no 'format' attribute: not an ftkit checkpoint file"
            elif isinstance(fmt, str) and fmt.startswith("ftkit-hdf5-"):
                why = (f"format {fmt!r} carries no metadata checksums (written by an older "
                       f"ftkit) and is not trusted; this ftkit reads {FORMAT!r}")
            else:
                why = f"format {fmt!r}, expected {FORMAT!r}"
            raise CorruptCheckpointError(where, why, step=step, level="pfs")
        check_seal(h5, root_canon(h5), where, rank=None, step=step)
        attrs = attrs_of(h5)
    except CorruptCheckpointError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(where, f"unreadable file metadata: {reason(exc)}",
                                     step=step, level="pfs") from exc
    if step is not None and "step" in attrs and attrs["step"] != step:
        raise CorruptCheckpointError(where, f"index says step {attrs['step']}, expected {step}",
                                     step=step, level="pfs")
    return attrs


def reason(exc: BaseException) -> str:
    """What went wrong, in a few words (a KeyError: the key)."""
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# --------------------------------------------------------------------------- writing

def write_rank_group(h5: Any, shard: ShardData, topology: dict[str, Any], sink: H5Sink
                     ) -> None:
    """Write one rank's shard as ``/rank/<r>`` into an open h5py file, verifying every
    tensor's bytes against the shard's checksum on the way (CorruptCheckpointError: the
    shard is corrupt, nothing of it may reach the PFS), then seal the group. Tensors of
    :data:`RAW_MIN` bytes or more become contiguous datasets allocated at once and never
    filled (:func:`create_unfilled`), whose bytes ftkit writes at their place through
    ``sink`` (the file under ``h5``), hashed piece by piece in the same pass
    (:func:`fill_tensor`)."""
    grp = create_rank_group(h5, shard.header, topology)
    with cf.ThreadPoolExecutor(1, thread_name_prefix="ftkit-h5-hash") as hasher:
        for i, name in enumerate(dataset_names(shard.tensors)):
            _write_tensor(grp, name, shard, i, sink, hasher)
    seal(grp)


def create_rank_group(h5: Any, header: dict[str, Any], topology: dict[str, Any]) -> Any:
    """The group ``/rank/<r>`` of the shard whose header is ``header``, with its identity,
    ``tree`` and ``topology`` attributes (no datasets yet, not sealed)."""
    grp = h5.create_group(f"rank/{header['rank']}")
    for key in ("rank", "step", "world", "job"):
        grp.attrs[key] = header[key]
    grp.attrs["tree"] = json.dumps(header["tree"])
    grp.attrs["topology"] = json.dumps(topology)
    return grp


def tensor_attrs(header: dict[str, Any], index: int) -> dict[str, Any]:
    """The attributes of the dataset of tensor ``index`` of a shard with ``header``: its
    description, and where the tensor is a declared shard (header ``shards``,
    :mod:`ftkit.capture.shards`) ``global_shape``, ``shard_dim`` (the one dimension it is
    cut along; -2: several chunks or dimensions, -1: not a shard), ``shard_offset`` and
    ``shard_offsets``/``shard_sizes`` (one row per chunk); ``ftkit_key`` its global name
    where the header has one (header ``keys``). ValueError for a spec that does not fit."""
    t = header["tensors"][index]
    attrs = {"checksum": t["checksum"], "ftkit_kind": t["kind"], "ftkit_dtype": t["dtype"],
             "ftkit_index": index, "ftkit_raw": storage_dtype(t) is None,
             "ftkit_path": t["path"], "ftkit_shape": np.asarray(t["shape"], dtype=np.int64),
             "global_shape": list(t["shape"]) or [0], "shard_offset": 0, "shard_dim": -1}
    found = header_table(header, "shards").get(str(index))
    if found is not None:
        spec = ShardSpec.from_json(found, math.prod(t["shape"]))
        dim = spec.dim
        attrs.update(
            global_shape=list(spec.global_shape), shard_dim=-2 if dim is None else dim,
            shard_offset=0 if dim is None else spec.chunks[0].offsets[dim],
            shard_offsets=np.asarray([c.offsets for c in spec.chunks], dtype=np.int64),
            shard_sizes=np.asarray([c.sizes for c in spec.chunks], dtype=np.int64))
    key = header_table(header, "keys").get(str(index))
    if key is not None:
        if not isinstance(key, str):
            raise ValueError(f"tensor {index}: key {key!r} is not a string")
        attrs["ftkit_key"] = key
    return attrs


def _write_tensor(grp: Any, name: str, shard: ShardData, i: int, sink: H5Sink,
                  hasher: cf.ThreadPoolExecutor) -> None:
    """Tensor ``i`` of ``shard`` as dataset ``name`` of ``grp``, checked, with its attributes."""
    t = shard.tensors[i]
    dtype = storage_dtype(t)
    blocks: list[int] = []
    if t["nbytes"] >= RAW_MIN:
        ds = create_unfilled(grp, name, t)
        blocks = fill_tensor(shard, i, int(ds.id.get_offset()), sink, hasher)
    else:
        raw = shard.raw(i)
        if checksum(raw) != t["checksum"]:
            raise corrupt_shard(shard, t)
        data = raw if dtype is None else raw.view(dtype).reshape(t["shape"])
        ds = grp.create_dataset(name, data=data)          # contiguous
    attrs = tensor_attrs(shard.header, i)
    if blocks:
        attrs.update(block_bytes=BLOCK_BYTES,
                     block_checksums=np.asarray(blocks, dtype=np.uint64))
    ds.attrs.update(attrs)


def create_unfilled(grp: Any, name: str, t: dict[str, Any]) -> Any:
    """A contiguous dataset ``name`` of ``grp`` for tensor ``t`` (a header entry), its space
    allocated when it is created and never filled by libhdf5: ftkit writes its bytes at the
    dataset's offset (:func:`fill_tensor`). Created through the low-level API: h5py's
    ``create_dataset`` allocates a scalar dataset late whatever it is asked. OSError when
    HDF5 did not allocate exactly the tensor's bytes (a tensor of no bytes gets no storage)."""
    h5py = _h5py()
    dtype = storage_dtype(t)
    shape = (t["nbytes"],) if dtype is None else tuple(t["shape"])
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
    lcpl.set_create_intermediate_group(True)
    space = h5py.h5s.create_simple(shape) if shape else h5py.h5s.create(h5py.h5s.SCALAR)
    tid = h5py.h5t.py_create(np.dtype(np.uint8) if dtype is None else dtype)
    ds = h5py.Dataset(h5py.h5d.create(grp.id, name.encode(), tid, space, dcpl=dcpl,
                                      lcpl=lcpl))
    offset = ds.id.get_offset()
    if t["nbytes"] and (offset is None or ds.id.get_storage_size() != t["nbytes"]):
        raise OSError(f"HDF5 allocated {ds.id.get_storage_size()} bytes at {offset} for "
                      f"{t['nbytes']}-byte tensor {t['path']!r}")
    return ds


def fill_tensor(shard: ShardData, index: int, offset: int, sink: H5Sink,
                hasher: cf.ThreadPoolExecutor, *, with_blocks: bool = True) -> list[int]:
    """Write tensor ``index`` of ``shard`` at ``offset`` of the file under ``sink`` from the
    mapped shard in :data:`RAW_PIECE` pieces (``O_DIRECT`` where the file system allows:
    :meth:`H5Sink.write_bulk`), each hashed before it is written (:func:`_hashed_pieces`),
    the whole checked against the tensor's checksum (a mismatch raises
    CorruptCheckpointError: the file is then discarded). Returns each piece's xxh3-64 (the
    ``block_checksums`` of :data:`BLOCK_BYTES` blocks) when there are several, up to
    :data:`MAX_BLOCKS`, and ``with_blocks``; else []."""
    t = shard.tensors[index]
    raw, h = shard.raw(index), xxhash.xxh3_64()
    blocks: list[int] | None = [] if with_blocks and \
        1 < -(-raw.nbytes // RAW_PIECE) <= MAX_BLOCKS else None
    for at, piece in _hashed_pieces(raw, h, hasher, blocks):
        sink.write_bulk(piece, offset + at)
    passes.count("hash", t["nbytes"] * (1 if blocks is None else 2))
    if XXH3 + h.hexdigest() != t["checksum"]:
        raise corrupt_shard(shard, t)
    return blocks or []


def _hashed_pieces(raw: np.ndarray, h: Any, hasher: cf.ThreadPoolExecutor,
                   blocks: list[int] | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """``(offset, piece)`` of ``raw`` in :data:`RAW_PIECE` pieces, each yielded once ``h``
    has hashed it (and, with ``blocks``, its own xxh3-64 appended there); the next piece is
    hashed on ``hasher``'s thread while the caller writes this one (xxhash holds the GIL, a
    write releases it: hashing the next piece on the caller's thread instead would wait for
    the GIL, not overlap). A hash still running when the caller gives up ends before
    ``hasher`` shuts down, before the shard is unmapped."""
    def hash_piece(piece: memoryview) -> None:
        h.update(piece)
        if blocks is not None:
            blocks.append(xxhash.xxh3_64_intdigest(piece))

    def ahead(at: int) -> cf.Future[None] | None:
        return hasher.submit(hash_piece, raw[at:at + RAW_PIECE].data) \
            if at < raw.nbytes else None
    pending = ahead(0)
    for at in range(0, raw.nbytes, RAW_PIECE):
        assert pending is not None
        pending.result()
        pending = ahead(at + RAW_PIECE)
        yield at, raw[at:at + RAW_PIECE]


def corrupt_shard(shard: ShardData, t: dict[str, Any]) -> CorruptCheckpointError:
    h = shard.header
    return CorruptCheckpointError(
        str(shard.path), f"tensor {t['path']!r} does not match its checksum {t['checksum']}: "
        f"the node-local shard is corrupt and is not copied to the PFS", rank=h["rank"],
        step=h["step"], level="local")


def write_temp(path: Path, fill: Callable[[Any, H5Sink], None]
               ) -> tuple[Path, dict[str, Any]]:
    """Create an HDF5 file under a new private temp name beside ``path``
    (:func:`~ftkit.fs.create_temp`): ``fill`` writes into it, its root is then
    sealed; fsync. Written through :mod:`ftkit.storage.pfs.h5sink`, so a full or failing file
    system raises here, inside the caller's error handling, and nothing of the temp file
    (which is removed) can fail later. Returns the temp path and the file digest (for
    COMMITTED, :mod:`ftkit.storage.pfs.h5files`)."""
    def fill_sealed(h5: Any, sink: H5Sink) -> None:
        fill(h5, sink)
        seal(h5)
    fd, tmp = create_temp(path)
    try:
        try:
            write_new_file(fd, fill_sealed, str(tmp))
        finally:
            os.close(fd)
        return tmp, h5files.file_digest(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_atomic(path: Path, fill: Callable[[Any, H5Sink], None]) -> dict[str, Any]:
    """Create an HDF5 file at ``path`` atomically (:func:`write_temp`, rename, fsync of the
    directory). Returns the file digest."""
    tmp, digest = write_temp(path, fill)
    rename_into_place(tmp, path)
    return digest


def _ranks_fill(shards: Sequence[ShardData], topology: dict[int, dict[str, Any]]
                ) -> Callable[[Any, H5Sink], None]:
    """What fills a file holding the rank groups of ``shards``."""
    def fill(h5: Any, sink: H5Sink) -> None:
        h5.attrs["format"] = FORMAT
        for shard in shards:
            write_rank_group(h5, shard, topology[shard.header["rank"]], sink)
    return fill


def write_node_file(path: Path, shards: list[Shard], topology: dict[int, dict[str, Any]]
                    ) -> dict[str, Any]:
    """Write a file holding the rank groups of ``shards`` atomically (the layout of node
    files before rank files existed, still read; a rank file holds one); a corrupt shard
    raises CorruptCheckpointError and leaves no file. Returns its file digest."""
    return _write_atomic(path, _ranks_fill(shards, topology))


def write_rank_file(path: Path, shard: Shard, topology: dict[str, Any]) -> dict[str, Any]:
    """Write one rank's file (``rank-<r>.h5``: the format attribute and ``/rank/<r>``)
    atomically, its tensors checked against the shard's checksums on the way (a corrupt shard
    raises CorruptCheckpointError and leaves no file). Returns its file digest."""
    return write_node_file(path, [shard], {shard.header["rank"]: topology})


def write_rank_temp(path: Path, shard: ShardData, topology: dict[str, Any]
                    ) -> tuple[Path, dict[str, Any]]:
    """:func:`write_rank_file`'s content under a temp name beside ``path``
    (:func:`write_temp`), left for the caller to rename: the temp path and its digest."""
    return write_temp(path, _ranks_fill([shard], {shard.header["rank"]: topology}))


def write_node_links(path: Path, ranks: list[int]) -> dict[str, Any]:
    """Write a node file that holds no data (``node-<id>.h5``): external links ``/rank/<r>``
    into each of the node's rank files ``rank-<r>.h5``, so the node's part of the step reads
    as one file with plain h5py. Atomic; returns its file digest."""
    h5py = _h5py()

    def fill(h5: Any, _sink: H5Sink) -> None:
        h5.attrs["format"] = FORMAT
        group = h5.create_group("rank")
        for rank in sorted(ranks):
            group[str(rank)] = h5py.ExternalLink(f"rank-{rank}.h5", f"/rank/{rank}")
    return _write_atomic(path, fill)


def write_index(step_dir: Path, meta: dict[str, Any], rank_files: dict[int, str]
                ) -> dict[str, Any]:
    """Write ``ftkit.h5`` atomically: job attributes and external links to every rank's
    group. Returns its file digest."""
    h5py = _h5py()

    def fill(h5: Any, _sink: H5Sink) -> None:
        h5.attrs.update({"format": FORMAT, "time": time.time(), **meta})
        ranks = h5.create_group("rank")
        for rank, fname in sorted(rank_files.items()):
            ranks[str(rank)] = h5py.ExternalLink(fname, f"/rank/{rank}")
    return _write_atomic(step_dir / INDEX, fill)


def record_checksum(record: dict[str, Any]) -> str:
    """xxh3-64 of a COMMITTED record's canonical JSON, its ``checksum`` key left out."""
    return _digest({k: v for k, v in record.items() if k != "checksum"})


def write_commit(step_dir: Path, record: dict[str, Any]) -> None:
    """Durably write ``step_dir/COMMITTED`` with ``checksum`` over the rest of the record."""
    write_atomic(step_dir / COMMITTED,
                 [json.dumps({**record, "checksum": record_checksum(record)}).encode()])


def read_commit(step_dir: Path, step: int | None = None) -> dict[str, Any]:
    """The verified COMMITTED record of a PFS step (a regular file of at most 16 MiB, JSON,
    its checksum matching, its ``step`` the expected one). CorruptCheckpointError else."""
    path = step_dir / COMMITTED

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(str(path), why, step=step, level="pfs")
    size = h5files.regular_file(path, step=step)
    if size > 16 << 20:
        raise bad(f"is {size} bytes; a commit record is small")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            data = os.read(fd, size + 1)
        finally:
            os.close(fd)
        record = json.loads(data)
    except (OSError, ValueError, RecursionError) as exc:
        raise bad(f"unreadable commit record: {reason(exc)}") from exc
    if not isinstance(record, dict) or record.get("checksum") != record_checksum(record):
        raise bad("commit record checksum mismatch (damaged or edited), or a record written "
                  "without one by an older ftkit")
    if step is not None and record.get("step") != step:
        raise bad(f"commit record says step {record.get('step')!r}, expected {step}")
    return record


def make_step_dir(step_dir: Path) -> None:
    """Create ``step_dir`` (and missing parents, mode 0700) durably: the parent of every
    directory created is fsynced (by :func:`ftkit.storage.local.make_private_dir`)."""
    from ftkit.storage.local import make_private_dir
    make_private_dir(step_dir)


def retract_commit(step_dir: Path) -> bool:
    """Durably remove ``step_dir/COMMITTED`` (unlink, fsync the directory) before a step is
    written again, so a crash leaves an incomplete step, never two timelines mixed under one
    record. True when there was one."""
    try:
        (step_dir / COMMITTED).unlink()
    except FileNotFoundError:
        return False
    fsync_dir(step_dir)
    return True


# --------------------------------------------------------------------------- reading

def raw_bytes(a: Any) -> np.ndarray:
    """The bytes of an array read from a dataset, as a flat uint8 array (C order)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def datasets(grp: Any) -> list[Any]:
    """Every dataset below an h5py group (links followed), sorted by name."""
    return [ds for _, ds in _dataset_list(grp)]
