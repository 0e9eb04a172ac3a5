"""``ftkit export``: one committed step as a single-process ``{path: tensor}`` file (or a
torch DCP directory).

The work runs in a sandboxed child (:mod:`ftkit.cli.sandbox`) and streams: the plan (which
datasets make which tensor, dtypes, shapes) is built from the verified metadata alone
(:class:`ftkit.storage.pfs.h5read.StepReader`, which checks every dataset's storage against its
file before anything is read), then each tensor's bytes are read in blocks, checked against
their checksums and written out:

* ``safetensors``: written by ftkit (no package needed): the header first, then each tensor;
* ``pt`` and ``dcp`` (:mod:`ftkit.cli.torchfmt`): each tensor's bytes go to a scratch file
  next to the output and ``torch.save`` / ``torch.distributed.checkpoint.save`` writes tensors
  that map those files, so anonymous memory stays at about one block.

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
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import xxhash

from ftkit.capture.flatten import itemsize, numpy_dtype
from ftkit.capture.rng import rank_local_indices
from ftkit.capture.shards import Chunk, first_overlap
from ftkit.cli import sandbox, torchfmt
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
from ftkit.cli.userkeys import user_view
from ftkit.errors import CorruptCheckpointError
from ftkit.fs import fsync_dir
from ftkit.storage.pfs.h5group import count_tensors

OK = 0
OUT = "out"                             # the output's name inside the scratch directory
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
    """One exported tensor: its key, dtype, shape and the datasets holding it: one, the
    shards along dimension 0 in offset order (``boxes`` None: their bytes one after the
    other), or shards anywhere (``boxes``: each part's chunks, placed in the output)."""

    key: str
    path: str
    dtype: str                     # torch dtype name
    shape: list[int]
    nbytes: int
    parts: list[Part]
    swap: np.dtype | None = None   # stored big-endian: read as this, byte-swapped
    boxes: list[list[Chunk]] | None = None


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


def _item(path: str, parts: list[Part], shape: list[int],
          boxes: list[list[Chunk]] | None = None) -> Item:
    entry = parts[0].entry
    dtype, swap = _target_dtype(entry)
    nbytes = math.prod(shape) * itemsize(entry["kind"], entry["dtype"])
    return Item("", path, dtype, shape, nbytes, parts, swap, boxes)


def _key(part: Part) -> str:
    """The name a tensor is exported under: its global key where it has one (optimizer
    state: ``optim/state/<parameter path>/<name>``, :mod:`ftkit.capture.shards`), else its
    state path."""
    return str(part.entry["key"] or part.entry["path"])


def _chunks(part: Part) -> list[Chunk]:
    return [Chunk(tuple(o), tuple(s)) for o, s in part.entry["shard"]["chunks"]]


def _replica(path: str, parts: list[Part], declared: bool) -> Item:
    """A tensor several ranks hold without shard attributes: one copy when the step
    declares shards elsewhere (undeclared = replicated) and every copy is the same."""
    ranks = [p.rank for p in parts]
    if not declared:
        raise ExportError(
            f"cannot export tensor {path!r}: ranks {_compact(ranks)} each hold it without "
            f"shard attributes (shard_dim -1), so ftkit cannot tell TP/PP shards from "
            f"replicas; only data-parallel (tp = pp = 1) checkpoints or tensors declared "
            f"with ftkit.declare_shard (shard_dim/shard_offset/global_shape) can be exported")
    first = parts[0]
    for other in parts[1:]:
        if (other.entry["checksum"], other.entry["shape"]) != (first.entry["checksum"],
                                                                first.entry["shape"]):
            raise ExportError(f"cannot export tensor {path!r}: ranks {first.rank} and "
                              f"{other.rank} hold it without a shard declaration, but "
                              f"different data (a TP/PP shard not declared with "
                              f"ftkit.declare_shard?)")
    return _item(path, [first], first.entry["shape"])


def _merged(path: str, parts: list[Part], more: list[Part]) -> Item:
    """The shards of one tensor, checked to tile its global shape exactly once (parts
    with the same chunks must hold the same bytes; one of them is used). The parts of
    ``more`` (other data-parallel ranks) are added only when ``parts`` do not cover it."""
    known = {tuple(_chunks(p)) for p in parts if p.entry["shard"]}
    shard = parts[0].entry["shard"]
    if shard is not None and sum(c.numel for cs in known for c in cs) < \
            math.prod(shard["global_shape"]):
        parts = parts + [p for p in more if not p.entry["shard"]
                         or tuple(_chunks(p)) not in known]
    ranks = [p.rank for p in parts]
    gshapes = {tuple(p.entry["shard"]["global_shape"]) if p.entry["shard"] else None
               for p in parts}
    dtypes = {(p.entry["kind"], p.entry["dtype"]) for p in parts}
    if None in gshapes or len(gshapes) != 1 or len(dtypes) != 1:
        raise ExportError(f"cannot export tensor {path!r}: its shards on ranks "
                          f"{_compact(ranks)} disagree on global_shape "
                          f"{sorted(gshapes, key=str)} or dtype {sorted(dtypes)} (or some are "
                          f"not declared shards)")
    gshape = list(gshapes.pop() or ())
    by_chunks: dict[tuple[Chunk, ...], Part] = {}
    for part in parts:
        other = by_chunks.setdefault(tuple(_chunks(part)), part)
        if other.entry["checksum"] != part.entry["checksum"]:
            raise ExportError(f"cannot export tensor {path!r}: ranks {other.rank} and "
                              f"{part.rank} hold different data for the same chunks")
    used = sorted(by_chunks.values(), key=lambda p: _chunks(p)[0].offsets)
    boxes = [_chunks(p) for p in used]
    flat = [c for cs in boxes for c in cs]
    clash = first_overlap(flat)
    covered = sum(c.numel for c in flat)
    if clash is not None or covered != math.prod(gshape):
        owner = [p.rank for p, cs in zip(used, boxes) for _ in cs]
        why = (f"the shards of ranks {owner[clash[0]]} and {owner[clash[1]]} overlap"
               if clash is not None else
               f"the shards cover {covered} of its {math.prod(gshape)} elements")
        raise ExportError(f"cannot export tensor {path!r} ({gshape}): {why}")
    if all(len(cs) == 1 and list(cs[0].sizes[1:]) == gshape[1:] for cs in boxes):
        return _item(path, used, gshape)               # slices along dim 0, in order
    return _item(path, used, gshape, boxes)


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


def _rank_local(group: Any) -> set[int]:
    """Indices of a rank's tensors that are its own by nature (``ftkit.RNGState``: every
    rank draws its own streams): the lowest rank's copy is exported."""
    try:
        return rank_local_indices(group.tree)
    except (TypeError, ValueError, RecursionError) as exc:
        raise ExportError(f"{group.where}: tree attribute does not decode: {exc}") from exc


def _partial(part: Part) -> bool:
    """Whether a part is a declared shard that is not the whole of its global tensor."""
    shard = part.entry["shard"]
    return shard is not None and sum(math.prod(size) for _, size in shard["chunks"]) < \
        math.prod(shard["global_shape"])


def plan(reader: Any, rep: Reporter) -> tuple[list[Item], str, int]:
    """(the tensors to export, where they come from, how many the tree(s) hold); reads no
    tensor data. ExportError / CorruptCheckpointError when the step cannot be exported.
    Data-parallel ranks are replicas: the ``dp_idx == 0`` ranks' tensors are used, and
    those of other ranks only for a tensor whose declared shards they do not cover (state
    sharded across data-parallel ranks, e.g. FSDP)."""
    world, tp, pp, linked = _layout(reader)
    group, parts = _parts(reader, 0, rep)
    if tp * pp == 1 and not any(_partial(p) for p in parts):
        source = f"rank 0 (data-parallel replicas, world {world})" if world > 1 else "rank 0"
        return ([_item(_key(p), [p], p.entry["shape"]) for p in parts], source,
                count_tensors(group.tree))
    if linked < world:
        raise ExportError(f"{reader.path}: links {linked} ranks but world is {world}")
    held: dict[str, list[Part]] = {}
    others: dict[str, list[Part]] = {}
    first = []
    for rank in range(world):
        if rank:
            group, parts = _parts(reader, rank, rep)
        dp_idx = group.topology.get("dp_idx", (rank // tp) % (world // (tp * pp)))
        if not isinstance(dp_idx, int) or isinstance(dp_idx, bool):
            raise ExportError(f"{group.where}: topology dp_idx {dp_idx!r} is not an integer")
        if dp_idx == 0:
            first.append(rank)
        local = _rank_local(group)
        into = held if dp_idx == 0 else others
        for part in parts:
            same = into.setdefault(_key(part), [])
            if not (same and part.entry["index"] in local):
                same.append(part)
    if len(first) != tp * pp:
        raise ExportError(f"{reader.path}: ranks [{_compact(first)}] have dp_idx 0, but tp x "
                          f"pp = {tp * pp} ranks must (topology attributes do not match the "
                          f"index's world {world}, tp {tp}, pp {pp})")
    declared = any(p.entry["shard"] is not None for ps in held.values() for p in ps)
    items = [(_item(path, ps, ps[0].entry["shape"]) if len(ps) == 1 else
              _replica(path, ps, declared)) if all(p.entry["shard"] is None for p in ps)
             else _merged(path, ps, others.get(path, [])) for path, ps in held.items()]
    used = sorted({p.rank for item in items for p in item.parts})
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


def item_blocks(item: Item, rep: Reporter) -> Iterator[np.ndarray]:
    """The bytes of an exported tensor whose parts follow one another (``item.boxes``
    None), little-endian, block by block."""
    for part in item.parts:
        for block in _part_blocks(part, rep):
            yield block if item.swap is None else \
                block.view(item.swap).byteswap().view(np.uint8)


class _Stream:
    """A part's bytes (checked against its checksum once all are taken) handed out in
    pieces of the sizes asked for."""

    def __init__(self, part: Part, rep: Reporter) -> None:
        self.part, self.blocks, self.left = part, _part_blocks(part, rep), np.empty(0, np.uint8)

    def take(self, n: int) -> np.ndarray:
        pieces, have = [self.left], self.left.nbytes
        while have < n:
            block = next(self.blocks, None)
            if block is None:
                raise ExportError(f"{self.part.where}: ended after {have} of the bytes its "
                                  f"shard chunks need (rank {self.part.rank})")
            pieces.append(block)
            have += block.nbytes
        data = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        self.left = data[n:]
        return data[:n]

    def finish(self) -> None:
        rest = self.left.nbytes + sum(b.nbytes for b in self.blocks)   # checks the checksum
        if rest:
            raise ExportError(f"{self.part.where}: {rest} bytes left over after its shard "
                              f"chunks (rank {self.part.rank})")


def _place(box: np.ndarray, stream: _Stream, swap: np.dtype | None) -> None:
    """Fill ``box`` (a strided uint8 view ``(*sizes, itemsize)`` of the output) with the
    next bytes of ``stream`` in C order, at most about a block at a time."""
    sizes, isz = box.shape[:-1], box.shape[-1]
    k = len(sizes)          # units: the trailing dims from k on, as large as fit a block
    while k > 0 and math.prod(sizes[k - 1:]) * isz <= BLOCK_BYTES:
        k -= 1
    unit = math.prod(sizes[k:]) * isz
    lines: Iterable[tuple[int, ...]] = [()] if k == 0 else np.ndindex(*sizes[:k - 1])
    count = 1 if k == 0 else sizes[k - 1]
    per = 1 if k == 0 else max(1, BLOCK_BYTES // unit)
    for line in lines:
        for start in range(0, count, per):
            m = min(per, count - start)
            data = stream.take(m * unit)
            if swap is not None:
                data = data.view(swap).byteswap().view(np.uint8)
            where: tuple[Any, ...] = (*line, slice(start, start + m)) if k else ()
            box[where] = data.reshape(box[where].shape)


def _place_all(item: Item, out: np.ndarray, rep: Reporter) -> None:
    """Every part's chunks of ``item`` into ``out`` (uint8 ``(*shape, itemsize)``)."""
    assert item.boxes is not None
    for part, chunks in zip(item.parts, item.boxes):
        stream = _Stream(part, rep)
        for c in chunks:
            _place(out[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))], stream,
                   item.swap)
        stream.finish()


def _copy(item: Item, fh: IO[bytes] | None, rep: Reporter) -> None:
    """Write one tensor's bytes at ``fh``'s position (None: only read and check them);
    a tensor of shards anywhere is placed through a map of that part of the file."""
    if item.boxes is not None and fh is not None and item.nbytes:
        pos = fh.tell()
        fh.flush()
        os.ftruncate(fh.fileno(), max(os.fstat(fh.fileno()).st_size, pos + item.nbytes))
        isz = item.nbytes // math.prod(item.shape)
        out = np.memmap(fh, dtype=np.uint8, mode="r+", offset=pos,
                        shape=(*item.shape, isz))
        _place_all(item, out, rep)
        out.flush()
        del out
        fh.seek(pos + item.nbytes)
        return
    if item.boxes is not None:
        for part in item.parts:
            _Stream(part, rep).finish()
        return
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
    with open(out, "w+b") as fh:
        fh.write(struct.pack("<Q", len(text)) + text)
        for item in items:
            _copy(item, fh, rep)


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
            items = user_view(items)          # not ftkit's own tensors, no DDP prefix
            if only is not None:
                items = select(items, only, ref.label)
            meta = {"ftkit_job": str(reader.meta.get("job", "")),
                    "ftkit_step": str(reader.meta.get("step", ref.step)),
                    "ftkit_source": source}
            if fmt == "safetensors":
                write_safetensors(items, scratch / OUT, meta, rep)
            elif fmt == "dcp":
                torchfmt.write_dcp(items, scratch / OUT, scratch, rep, _copy, meta)
            else:
                torchfmt.write_pt(items, scratch / OUT, scratch, rep, _copy)
    except CorruptCheckpointError as exc:
        where = ", ".join(x for x in (f"rank {exc.rank}" if exc.rank is not None else "",
                                      f"step {exc.step}" if exc.step is not None else "") if x)
        raise ExportError(f"{exc.path}: {exc.reason}" + (f" ({where})" if where else "")
                          ) from exc
    return {"tensors": len(items), "bytes": sum(i.nbytes for i in items), "source": source}


def _export_format(args: argparse.Namespace) -> str:
    fmt: str = args.format or ("safetensors" if args.out.endswith(".safetensors") else "pt")
    if fmt in ("pt", "dcp"):
        try:        # imported once, before the child is forked
            import torch
            if fmt == "dcp":
                import torch.distributed.checkpoint  # noqa: F401
        except ImportError as exc:
            raise UsageError(f"--format {fmt} needs torch ({exc}); --format safetensors "
                             f"does not") from exc
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
    fmt = _export_format(args)
    if fmt == "dcp" and out.exists():
        raise UsageError(f"--out {out} exists; --format dcp writes a new directory")
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory")
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
