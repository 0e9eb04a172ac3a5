"""``ftkit export``: one committed step as a single-process ``{path: tensor}`` file.

The work runs in a sandboxed child (:mod:`ftkit.cli.sandbox`) and streams: the plan (which
datasets make which tensor, dtypes, shapes) is built from the verified metadata alone
(:class:`ftkit.storage.pfs.h5read.StepReader`, which checks every dataset's storage against its
file before anything is read), then each tensor's bytes are read in blocks, checked against
their checksums and written out:

* ``safetensors``: written by ftkit (no package needed): the header first, then each tensor;
* ``pt``: each tensor's bytes go to a scratch file next to the output and ``torch.save``
  writes tensors that map those files (``torch.from_file``, shared), so anonymous memory stays
  at about one block (TP/PP shards: one block of rows of every shard).

The output is written inside a scratch directory next to FILE and renamed into place by the
parent only when complete: exactly the tensors of the tree(s), or nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import xxhash

from ftkit.capture.flatten import itemsize, numpy_dtype
from ftkit.cli import sandbox
from ftkit.cli.fmt import human
from ftkit.cli.scan import (
    BLOCK_BYTES,
    ExportError,
    Reporter,
    StepRef,
    UsageError,
    _compact,
    iter_blocks,
    link_target,
    open_step,
    rank_names,
    resolve,
)
from ftkit.errors import CorruptCheckpointError
from ftkit.storage.pfs.h5group import count_tensors
from ftkit.storage.pfs.hdf5 import raw_bytes as _raw
from ftkit.storage.shard import fsync_dir

OK = 0
OUT, DATA = "out", "data"               # names inside the scratch directory
#: numpy dtype (little-endian) -> torch dtype name
_NUMPY_TORCH = {"|b1": "bool", "|u1": "uint8", "|i1": "int8", "<i2": "int16", "<u2": "uint16",
                "<i4": "int32", "<u4": "uint32", "<i8": "int64", "<u8": "uint64",
                "<f2": "float16", "<f4": "float32", "<f8": "float64", "<c8": "complex64",
                "<c16": "complex128"}
#: torch dtype name -> safetensors dtype
_SAFETENSORS = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16",
                "int32": "I32", "uint32": "U32", "int64": "I64", "uint64": "U64",
                "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64",
                "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


# --------------------------------------------------------------------------- the plan

@dataclasses.dataclass
class Part:
    """One dataset holding (a shard of) a tensor."""

    rank: int
    entry: dict[str, Any]          # verified tensor entry (:class:`h5group.RankGroup`) + file
    ds: Any
    step: int | None

    @property
    def where(self) -> str:
        return f"{self.entry['file']}:{self.ds.name}"


@dataclasses.dataclass
class Item:
    """One exported tensor: its key, dtype, shape and the datasets holding it (one, or the
    shards in offset order with ``dim`` their dimension)."""

    key: str
    path: str
    dtype: str                     # torch dtype name
    shape: list[int]
    nbytes: int
    parts: list[Part]
    swap: np.dtype | None = None   # stored big-endian: read as this, byte-swapped
    dim: int | None = None


def _target_dtype(entry: dict[str, Any]) -> tuple[str, np.dtype | None]:
    """(torch dtype name, big-endian dtype to swap from or None) of a tensor entry."""
    if entry["kind"] == "torch":
        return entry["dtype"], None
    try:
        dt = numpy_dtype(entry["dtype"])
    except (TypeError, ValueError) as exc:
        raise ExportError(f"tensor {entry['path']!r}: numpy dtype {entry['dtype']}: "
                          f"{exc}") from exc
    little = dt.newbyteorder("<") if dt.byteorder == ">" else dt
    name = _NUMPY_TORCH.get(little.str)
    if name is None:
        raise ExportError(f"tensor {entry['path']!r} has numpy dtype {entry['dtype']}, which "
                          f"has no torch/safetensors equivalent; the step cannot be exported "
                          f"whole")
    return name, (dt if dt.byteorder == ">" else None)


def _item(parts: list[Part], shape: list[int], dim: int | None) -> Item:
    entry = parts[0].entry
    dtype, swap = _target_dtype(entry)
    nbytes = math.prod(shape) * itemsize(entry["kind"], entry["dtype"])
    return Item("", entry["path"], dtype, shape, nbytes, parts, swap, dim)


def _merged(path: str, parts: list[Part]) -> Item:
    """The shards of one tensor, checked to tile its global shape along ``shard_dim``."""
    ranks = [p.rank for p in parts]
    shards = [p.entry["shard"] for p in parts]
    if any(s is None for s in shards):
        raise ExportError(
            f"cannot export tensor {path!r}: ranks {_compact(ranks)} each hold it without "
            f"shard attributes (shard_dim -1), so ftkit cannot tell TP/PP shards from "
            f"replicas; only data-parallel (tp = pp = 1) checkpoints or tensors with "
            f"shard_dim/shard_offset/global_shape can be exported")
    dims = {s["dim"] for s in shards}
    gshapes = {tuple(s["global_shape"]) for s in shards}
    dtypes = {(p.entry["kind"], p.entry["dtype"]) for p in parts}
    if len(dims) != 1 or len(gshapes) != 1 or len(dtypes) != 1:
        raise ExportError(f"cannot export tensor {path!r}: its shards on ranks "
                          f"{_compact(ranks)} disagree on shard_dim {sorted(dims)}, "
                          f"global_shape {sorted(gshapes)} or dtype {sorted(dtypes)}")
    dim, gshape = dims.pop(), list(gshapes.pop())
    if not 0 <= dim < len(gshape) or any(n < 0 for n in gshape):
        raise ExportError(f"cannot export tensor {path!r}: shard_dim {dim} outside its "
                          f"global shape {gshape}")
    by_offset: dict[int, Part] = {}
    for part in parts:
        off = part.entry["shard"]["offset"]
        other = by_offset.setdefault(off, part)
        if other.entry["checksum"] != part.entry["checksum"]:
            raise ExportError(f"cannot export tensor {path!r}: ranks {other.rank} and "
                              f"{part.rank} hold different shards at offset {off} of "
                              f"dimension {dim}")
    pos = 0
    for off, part in sorted(by_offset.items()):
        shape = part.entry["shape"]
        if (off != pos or len(shape) != len(gshape)
                or shape[:dim] + shape[dim + 1:] != gshape[:dim] + gshape[dim + 1:]):
            raise ExportError(f"cannot export tensor {path!r}: the shard of rank {part.rank} "
                              f"(shape {shape}, offset {off}) does not continue the {gshape} "
                              f"tensor at {pos} along dimension {dim}")
        pos += shape[dim]
    if pos != gshape[dim]:
        raise ExportError(f"cannot export tensor {path!r}: shards cover {pos} of "
                          f"{gshape[dim]} along dimension {dim}")
    return _item([p for _, p in sorted(by_offset.items())], gshape, dim)


def _layout(reader: Any) -> tuple[int, int, int, int]:
    """(world, tp, pp, ranks the file links) from the verified index attributes."""
    values = [reader.meta.get(k, 1) for k in ("world", "tp", "pp")]
    if (any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values)
            or values[0] % (values[1] * values[2])):
        raise ExportError(f"{reader.path}: world {values[0]!r}, tp {values[1]!r}, pp "
                          f"{values[2]!r} do not describe a layout (positive integers, tp x "
                          f"pp dividing world)")
    world, tp, pp = values
    return world, tp, pp, len(rank_names(reader))


def _parts(reader: Any, rank: int, rep: Reporter) -> tuple[Any, list[Part]]:
    """(verified group, its tensors as parts in tree order) of one rank."""
    rep.progress(link_target(reader, str(rank)))
    group = reader.group(rank)
    parts = [Part(rank, {**e, "file": group.file}, ds, reader.step)
             for e, ds in zip(group.entries, group.datasets)]
    return group, parts


def plan(reader: Any, rep: Reporter) -> tuple[list[Item], str, int]:
    """(the tensors to export, where they come from, how many the tree(s) hold); reads no
    tensor data. ExportError / CorruptCheckpointError when the step cannot be exported."""
    world, tp, pp, linked = _layout(reader)
    if tp * pp == 1:
        group, parts = _parts(reader, 0, rep)
        source = f"rank 0 (data-parallel replicas, world {world})" if world > 1 else "rank 0"
        return ([_item([p], p.entry["shape"], None) for p in parts], source,
                count_tensors(group.tree))
    if linked < world:
        raise ExportError(f"{reader.path}: links {linked} ranks but world is {world}")
    held: dict[str, list[Part]] = {}
    used = []
    for rank in range(world):
        group, parts = _parts(reader, rank, rep)
        dp_idx = group.topology.get("dp_idx", (rank // tp) % (world // (tp * pp)))
        if not isinstance(dp_idx, int) or isinstance(dp_idx, bool):
            raise ExportError(f"{group.where}: topology dp_idx {dp_idx!r} is not an integer")
        if dp_idx == 0:
            used.append(rank)
            for part in parts:
                held.setdefault(part.entry["path"], []).append(part)
    if len(used) != tp * pp:
        raise ExportError(f"{reader.path}: ranks [{_compact(used)}] have dp_idx 0, but tp x "
                          f"pp = {tp * pp} ranks must (topology attributes do not match the "
                          f"index's world {world}, tp {tp}, pp {pp})")
    items = [_item(ps, ps[0].entry["shape"], None)
             if len(ps) == 1 and ps[0].entry["shard"] is None else _merged(path, ps)
             for path, ps in held.items()]
    return items, f"merged from ranks {_compact(used)} (tp {tp}, pp {pp}, world {world})", \
        len(held)


def _name(items: list[Item]) -> None:
    """Unique keys: the state path (``_leaf/<i>`` when empty; ``#<i>`` added on a clash)."""
    seen: set[str] = set()
    for item in items:
        index = item.parts[0].entry["index"]
        key = item.path or f"_leaf/{index}"
        while key in seen:
            key = f"{key}#{index}"
        seen.add(key)
        item.key = key


# --------------------------------------------------------------------------- reading bytes

class _Checked:
    """The running xxh3-64 and byte count of one part, checked at the end."""

    def __init__(self, part: Part) -> None:
        self.part, self.h, self.n = part, xxhash.xxh3_64(), 0

    def add(self, block: np.ndarray) -> None:
        self.h.update(block.data)
        self.n += block.nbytes

    def check(self) -> None:
        e, got = self.part.entry, "xxh3-64:" + self.h.hexdigest()
        why = (f"read {self.n} bytes, expected {e['nbytes']}" if self.n != e["nbytes"] else
               f"checksum mismatch (stored {e['checksum']}, data has {got})"
               if got != e["checksum"] else None)
        if why is not None:
            raise ExportError(f"{self.part.where}: {why} (rank {self.part.rank}, step "
                              f"{self.part.step})")


def _read(part: Part, what: Any) -> Any:
    """``what()`` (reads a block of ``part``'s dataset); ExportError naming the dataset when
    the library cannot read it."""
    try:
        return what()
    except Exception as exc:
        raise ExportError(f"{part.where}: unreadable data: {type(exc).__name__}: {exc} (rank "
                          f"{part.rank}, step {part.step})") from exc


def _part_blocks(part: Part, rep: Reporter) -> Iterator[np.ndarray]:
    """A part's bytes in blocks, checked against its checksum at the end."""
    rep.progress(part.where)
    check = _Checked(part)
    blocks = iter_blocks(part.ds)
    while (block := _read(part, lambda: next(blocks, None))) is not None:
        check.add(block)
        rep.progress(nbytes=block.nbytes)
        yield block
    check.check()


def _rows(part: Part, start: int, count: int, isz: int) -> np.ndarray:
    """Rows ``start:start+count`` (dimension 0) of a part as uint8 ``(count, ..., isz)``."""
    shape = part.entry["shape"]
    row = math.prod(shape[1:]) * isz
    if tuple(part.ds.shape) != tuple(shape):          # stored as raw bytes
        data = _read(part, lambda: part.ds[start * row:(start + count) * row])
    else:
        data = _read(part, lambda: part.ds[start:start + count])
    return _raw(data).reshape(count, *shape[1:], isz)


def _merged_blocks(item: Item, rep: Reporter) -> Iterator[np.ndarray]:
    """A tensor merged along ``item.dim`` >= 1, in blocks of rows of every shard."""
    isz = itemsize(item.parts[0].entry["kind"], item.parts[0].entry["dtype"])
    checks = [_Checked(p) for p in item.parts]
    row = sum(math.prod(p.entry["shape"][1:]) for p in item.parts) * isz
    step = max(1, BLOCK_BYTES // max(1, row))
    for start in range(0, item.shape[0], step):
        count = min(step, item.shape[0] - start)
        pieces = []
        for check in checks:
            rep.progress(check.part.where)
            rows = _rows(check.part, start, count, isz)
            check.add(rows)
            pieces.append(rows)
        block = _raw(np.concatenate(pieces, axis=item.dim))
        rep.progress(nbytes=block.nbytes)
        yield block
    for check in checks:
        check.check()


def item_blocks(item: Item, rep: Reporter) -> Iterator[np.ndarray]:
    """The bytes of one exported tensor (little-endian, C order), block by block."""
    if item.dim:
        blocks = _merged_blocks(item, rep)
    else:
        blocks = (b for part in item.parts for b in _part_blocks(part, rep))
    for block in blocks:
        yield block if item.swap is None else block.view(item.swap).byteswap().view(np.uint8)


def _copy(item: Item, fh: IO[bytes] | None, rep: Reporter) -> None:
    """Write one tensor's bytes to ``fh`` (None: only read and check them)."""
    written = 0
    for block in item_blocks(item, rep):
        if fh is not None:
            fh.write(block.data)
        written += block.nbytes
    if written != item.nbytes:
        raise ExportError(f"tensor {item.path!r}: {written} bytes read, {item.nbytes} "
                          f"expected from its dtype and shape")


# --------------------------------------------------------------------------- writers

def write_safetensors(items: list[Item], out: Path, meta: dict[str, str],
                      rep: Reporter) -> None:
    """The safetensors format: 8-byte little-endian header length, JSON header (padded with
    spaces to 8 bytes), then every tensor's bytes in header order."""
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for item in items:
        code = _SAFETENSORS.get(item.dtype)
        if code is None or item.key == "__metadata__":
            raise ExportError(f"tensor {item.path!r}: safetensors has no dtype {item.dtype}"
                              if code is None else "a tensor is named '__metadata__', which "
                              "safetensors reserves; use --format pt")
        header[item.key] = {"dtype": code, "shape": item.shape,
                            "data_offsets": [offset, offset + item.nbytes]}
        offset += item.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(out, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
        for item in items:
            _copy(item, fh, rep)


class _Reporting:
    """A binary file for ``torch.save`` that reports progress every block written."""

    def __init__(self, fh: IO[bytes], rep: Reporter) -> None:
        self.fh, self.rep = fh, rep

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), BLOCK_BYTES):
            self.fh.write(view[start:start + BLOCK_BYTES])
            self.rep.progress(nbytes=min(BLOCK_BYTES, len(view) - start))
        return len(view)

    def flush(self) -> None:
        self.fh.flush()


def write_pt(items: list[Item], out: Path, scratch: Path, rep: Reporter) -> None:
    """``torch.save`` of ``{key: tensor}``; every tensor maps its own scratch file."""
    import torch
    tensors = {}
    for i, item in enumerate(items):
        dtype = getattr(torch, item.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ExportError(f"tensor {item.path!r}: torch has no dtype {item.dtype!r}")
        if item.nbytes == 0:
            _copy(item, None, rep)                  # still checks size and checksum
            tensors[item.key] = torch.empty(item.shape, dtype=dtype)
            continue
        path = scratch / f"{DATA}-{i}"
        with open(path, "wb") as fh:
            _copy(item, fh, rep)
        flat = torch.from_file(str(path), shared=True, size=item.nbytes, dtype=torch.uint8)
        tensors[item.key] = flat.view(dtype).reshape(item.shape)
    with open(out, "wb") as fh:
        torch.save(tensors, cast(IO[bytes], _Reporting(fh, rep)))


# --------------------------------------------------------------------------- the command

def select(items: list[Item], prefix: str, label: str) -> list[Item]:
    """The items under state path ``prefix``, keyed without ``prefix/`` (``--only``)."""
    prefix = prefix.strip("/")
    chosen = [item for item in items if item.key.startswith(prefix + "/")]
    if not chosen:
        tops = sorted({item.key.split("/", 1)[0] for item in items})
        raise ExportError(f"{label}: no tensor under {prefix!r} (the state's top-level keys: "
                          f"{', '.join(tops) or 'none'})")
    for item in chosen:
        item.key = item.key[len(prefix) + 1:]
    return chosen


def export_step(ref: StepRef, fmt: str, scratch: Path, rep: Reporter,
                only: str | None = None) -> dict[str, Any]:
    """Write ``scratch/out`` (the child's work); a summary for the parent. ``only``: the
    state path whose tensors alone are written (:func:`select`)."""
    rep.progress(str(ref.h5))
    try:
        with open_step(ref) as reader:
            items, source, expected = plan(reader, rep)
            _name(items)
            if len(items) != expected:
                raise ExportError(f"{ref.label}: {len(items)} tensors to write, but the "
                                  f"tree(s) hold {expected}")
            if only is not None:
                items = select(items, only, ref.label)
            meta = {"ftkit_job": str(reader.meta.get("job", "")),
                    "ftkit_step": str(reader.meta.get("step", ref.step)),
                    "ftkit_source": source}
            if fmt == "safetensors":
                write_safetensors(items, scratch / OUT, meta, rep)
            else:
                write_pt(items, scratch / OUT, scratch, rep)
    except CorruptCheckpointError as exc:
        where = ", ".join(x for x in (f"rank {exc.rank}" if exc.rank is not None else "",
                                      f"step {exc.step}" if exc.step is not None else "") if x)
        raise ExportError(f"{exc.path}: {exc.reason}" + (f" ({where})" if where else "")
                          ) from exc
    return {"tensors": len(items), "bytes": sum(i.nbytes for i in items), "source": source}


def _export_format(args: argparse.Namespace) -> str:
    fmt: str = args.format or ("safetensors" if args.out.endswith(".safetensors") else "pt")
    if fmt == "pt":
        try:
            import torch  # noqa: F401 - imported once, before the child is forked
        except ImportError as exc:
            raise UsageError(f"--format pt needs torch ({exc}); --format safetensors does "
                             f"not") from exc
    return fmt


def _pick(args: argparse.Namespace) -> StepRef:
    target = resolve(args.path)
    if args.step is None and not target.single:
        newest = target.newest()
        if newest is None or not newest.state()[0]:
            raise ExportError(f"no committed step in {args.path} (steps: "
                              f"{target.step_list()})")
        return newest
    ref = target.pick(args.step)
    committed, reason = ref.state()
    if not committed:
        raise ExportError(f"{ref.label} in {ref.dir} is incomplete: {reason}")
    return ref


def cmd_export(args: argparse.Namespace) -> int:
    out = Path(args.out)
    ref = _pick(args)
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: directory {out.parent} does not exist")
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory")
    fmt = _export_format(args)
    try:
        scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot write in {out.parent}: {exc.strerror}") from exc
    try:
        done = sandbox.run(lambda rep: export_step(ref, fmt, scratch, rep, getattr(args, "only", None)),
                           timeout=args.timeout, what=str(ref.h5), passthrough=(ExportError,))
        os.replace(scratch / OUT, out)
        fsync_dir(out.parent)
    except sandbox.SandboxError as exc:
        raise ExportError(f"{ref.label}: {exc}") from exc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"ftkit export: {ref.label}: {done['tensors']} tensors ({human(done['bytes'])}) "
          f"from {done['source']} -> {out} ({fmt})")
    return OK
