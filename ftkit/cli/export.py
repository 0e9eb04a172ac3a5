"""``ftkit export``: one committed step as a single-process ``{path: tensor}`` file."""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

OK, BAD, USAGE = 0, 1, 2

from ftkit.cli.scan import (
    ExportError,
    UsageError,
    _compact,
    _entry,
    _human,
    resolve,
)
from ftkit.errors import CorruptCheckpointError
from ftkit.storage import hdf5
from ftkit.storage.hdf5 import raw_bytes as _raw

# --------------------------------------------------------------------------- export

Piece = tuple[dict[str, Any], np.ndarray]          # (tensor entry, raw uint8 bytes)


def _read_rank(reader: hdf5.StepReader, rank: int) -> tuple[hdf5.RankGroup, list[Piece]]:
    """(verified group, [(entry, raw)] in tree order) of one rank, every checksum verified
    (CorruptCheckpointError otherwise)."""
    group, arrays = reader.read(rank)
    return group, [(_entry(e, Path(group.file)), raw) for e, raw in zip(group.entries, arrays)]


def _assemble(path: str, held: list[tuple[int, Piece]]) -> Piece:
    """Merge the shards of one tensor along ``shard_dim`` (ExportError when impossible)."""
    ranks = [r for r, _ in held]
    shards = [p[0]["shard"] for _, p in held]
    if any(s is None for s in shards):
        raise ExportError(
            f"cannot export tensor {path!r}: ranks {_compact(ranks)} each hold it without "
            f"shard attributes (shard_dim -1), so ftkit cannot tell TP/PP shards from "
            f"replicas; only data-parallel (tp = pp = 1) checkpoints or tensors with "
            f"shard_dim/shard_offset/global_shape can be exported")
    dims = {s["dim"] for s in shards}
    gshapes = {tuple(s["global_shape"]) for s in shards}
    dtypes = {p[0]["dtype"] for _, p in held}
    if len(dims) != 1 or len(gshapes) != 1 or len(dtypes) != 1:
        raise ExportError(f"cannot export tensor {path!r}: its shards on ranks "
                          f"{_compact(ranks)} disagree on shard_dim {sorted(dims)}, "
                          f"global_shape {sorted(gshapes)} or dtype {sorted(dtypes)}")
    dim, gshape = dims.pop(), list(gshapes.pop())
    if not 0 <= dim < len(gshape):
        raise ExportError(f"cannot export tensor {path!r}: shard_dim {dim} outside its "
                          f"global shape {gshape}")
    by_offset: dict[int, tuple[int, Piece]] = {}
    for rank, (entry, raw) in held:
        off = entry["shard"]["offset"]
        other = by_offset.get(off)
        if other is not None and other[1][0]["checksum"] != entry["checksum"]:
            raise ExportError(f"cannot export tensor {path!r}: ranks {other[0]} and {rank} "
                              f"hold different shards at offset {off} of dimension {dim}")
        by_offset.setdefault(off, (rank, (entry, raw)))
    blocks, pos = [], 0
    for off, (rank, (entry, raw)) in sorted(by_offset.items()):
        shape = entry["shape"]
        if (off != pos or len(shape) != len(gshape)
                or shape[:dim] + shape[dim + 1:] != gshape[:dim] + gshape[dim + 1:]):
            raise ExportError(f"cannot export tensor {path!r}: the shard of rank {rank} "
                              f"(shape {shape}, offset {off}) does not continue the "
                              f"{gshape} tensor at {pos} along dimension {dim}")
        count = math.prod(shape)
        item = raw.nbytes // count if count else 1
        blocks.append(raw.reshape(*shape, item))
        pos += shape[dim]
    if pos != gshape[dim]:
        raise ExportError(f"cannot export tensor {path!r}: shards cover {pos} of "
                          f"{gshape[dim]} along dimension {dim}")
    merged = _raw(np.concatenate(blocks, axis=dim))
    first = held[0][1][0]
    return {**first, "shape": gshape, "nbytes": merged.nbytes, "shard": None}, merged


def _merge_ranks(reader: hdf5.StepReader, world: int, tp: int, pp: int
                 ) -> tuple[list[Piece], str]:
    """The single-process tensors of a TP/PP checkpoint, merged from the dp_idx 0 ranks."""
    held: dict[str, list[tuple[int, Piece]]] = {}
    used = []
    for rank in range(world):
        group, pieces = _read_rank(reader, rank)
        dp_idx = group.topology.get("dp_idx", (rank // tp) % max(1, world // (tp * pp)))
        if dp_idx != 0:
            continue
        used.append(rank)
        for piece in pieces:
            held.setdefault(piece[0]["path"], []).append((rank, piece))
    out = [items[0][1] if len(items) == 1 and items[0][1][0]["shard"] is None
           else _assemble(path, items) for path, items in held.items()]
    return out, f"merged from ranks {_compact(used)} (tp {tp}, pp {pp}, world {world})"


def _to_torch(entry: dict[str, Any], raw: np.ndarray) -> Any:
    """A torch tensor (own memory) for one tensor entry, or None if torch has no such dtype."""
    import torch

    from ftkit.capture.flatten import TensorLeaf, leaf_from_bytes
    leaf = TensorLeaf(entry["path"], entry["kind"], entry["dtype"], tuple(entry["shape"]),
                      raw.nbytes)
    if not raw.flags.writeable:
        raw = raw.copy()
    try:
        value = leaf_from_bytes(leaf, raw)
    except (AttributeError, TypeError, ValueError) as exc:
        raise ExportError(f"cannot rebuild tensor {entry['path']!r} ({entry['kind']} dtype "
                          f"{entry['dtype']}, shape {entry['shape']}): {exc}") from exc
    if isinstance(value, torch.Tensor):
        return value.clone()
    arr = np.asarray(value)
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    try:
        return torch.from_numpy(np.array(arr, copy=True))
    except TypeError:
        return None


def _save(fmt: str, tensors: dict[str, Any], out: Path, meta: dict[str, str]) -> None:
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file
            save_file(tensors, str(tmp), metadata=meta)
        else:
            import torch
            torch.save(tensors, tmp)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _export_format(args: argparse.Namespace) -> str:
    fmt: str = args.format or ("safetensors" if args.out.endswith(".safetensors") else "pt")
    if fmt == "safetensors":
        try:
            import safetensors.torch  # noqa: F401
        except ImportError as exc:
            raise UsageError(f"--format safetensors needs the 'safetensors' package ({exc}); "
                             f"install it or use --format pt") from exc
    return fmt


def cmd_export(args: argparse.Namespace) -> int:
    target = resolve(args.path)
    out = Path(args.out)
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: directory {out.parent} does not exist")
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory")
    fmt = _export_format(args)
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"export needs torch ({exc})") from exc
    if args.step is None and not target.single:
        steps = ", ".join(str(r.step) for r in target.steps if r.state()[0]) or "none"
        raise UsageError(f"--step is required for a job directory (committed steps: {steps})")
    ref = target.pick(args.step)
    committed, reason = ref.state()
    if not committed:
        raise ExportError(f"{ref.label} in {ref.dir} is incomplete: {reason}")
    try:
        with hdf5.StepReader(ref.dir, ref.step, file=ref.h5) as reader:
            meta = reader.meta
            world, tp, pp = (int(meta.get(k, 1)) for k in ("world", "tp", "pp"))
            if tp * pp == 1:
                _, pieces = _read_rank(reader, 0)
                source = (f"rank 0 (data-parallel replicas, world {world})" if world > 1
                          else "rank 0")
            else:
                pieces, source = _merge_ranks(reader, world, tp, pp)
    except CorruptCheckpointError as exc:
        where = ", ".join(x for x in (f"rank {exc.rank}" if exc.rank is not None else "",
                                      f"step {exc.step}" if exc.step is not None else "") if x)
        raise ExportError(f"{exc.path}: {exc.reason}" + (f" ({where})" if where else "")
                          ) from exc
    tensors: dict[str, Any] = {}
    skipped = []
    nbytes = 0
    for entry, raw in pieces:
        value = _to_torch(entry, raw)
        if value is None:
            skipped.append(f"{entry['path']} ({entry['dtype']})")
            continue
        nbytes += raw.nbytes
        key = entry["path"] or f"_leaf/{entry['index']}"
        tensors[key if key not in tensors else f"{key}#{entry['index']}"] = value
    if skipped:
        print(f"ftkit export: skipped {len(skipped)} array(s) torch has no dtype for: "
              f"{', '.join(skipped)}", file=sys.stderr)
    _save(fmt, tensors, out, {"ftkit_job": str(meta.get("job", "")),
                              "ftkit_step": str(meta.get("step", ref.step)),
                              "ftkit_source": source})
    print(f"ftkit export: {ref.label}: {len(tensors)} tensors ({_human(nbytes)}) from {source}"
          f" -> {out} ({fmt})")
    return OK


