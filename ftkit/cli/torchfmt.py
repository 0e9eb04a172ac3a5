"""The torch output formats of ``ftkit export``: ``pt`` (one ``torch.save`` file) and ``dcp``
(a ``torch.distributed.checkpoint`` directory).

Both build the same tensors: each exported tensor's bytes go to a scratch file next to the
output (:func:`ftkit.cli.export.copy_item`, read in blocks and checked against their
checksums) and the tensor maps that file (``torch.from_file``, shared), so anonymous memory
stays at about one block whatever the step's size.

``dcp`` nests the flat export keys at their ``/``: ``model/blocks.0.w`` becomes
``{"model": {"blocks.0.w": ...}}``, which DCP stores under the fully qualified name
``model.blocks.0.w`` — what ``dcp.load({"model": model.state_dict()}, checkpoint_id=DIR)``
asks for; optimizer state is ``optim.state.<parameter path>.<name>``. It is written without a
process group (``no_dist``); DCP reads it with or without one, and into any sharding
(``DTensor`` placements). ``ftkit.json`` beside DCP's files records the job, step and source.
Only tensors are exported (hyperparameters, counters and RNG states stay in the HDF5 step).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, cast

from ftkit.cli.scan import BLOCK_BYTES, ExportError, Reporter

DATA = "data"                 # scratch files: DATA-<i>
DCP_META = "ftkit.json"       # what ftkit adds to a DCP directory

#: Writes one tensor's bytes at a file's position, checked (export's ``copy_item``).
Copier = Callable[[Any, "IO[bytes] | None", Reporter], None]


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


def tensors(items: list[Any], scratch: Path, rep: Reporter, copy: Copier) -> dict[str, Any]:
    """``{key: tensor}`` of export ``items``; every tensor maps its own scratch file."""
    import torch
    out = {}
    for i, item in enumerate(items):
        dtype = getattr(torch, item.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ExportError(f"tensor {item.path!r}: torch has no dtype {item.dtype!r}")
        if item.nbytes == 0:
            copy(item, None, rep)                  # still checks size and checksum
            out[item.key] = torch.empty(item.shape, dtype=dtype)
            continue
        path = scratch / f"{DATA}-{i}"
        with open(path, "w+b") as fh:
            copy(item, fh, rep)
        flat = torch.from_file(str(path), shared=True, size=item.nbytes, dtype=torch.uint8)
        out[item.key] = flat.view(dtype).reshape(item.shape)
    return out


def write_pt(items: list[Any], out: Path, scratch: Path, rep: Reporter, copy: Copier) -> None:
    """``torch.save`` of ``{key: tensor}``."""
    import torch
    flat = tensors(items, scratch, rep, copy)
    with open(out, "wb") as fh:
        torch.save(flat, cast(IO[bytes], _Reporting(fh, rep)))


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a/b/c": t}`` -> ``{"a": {"b": {"c": t}}}``; ExportError when a key is both a
    tensor and a prefix of another (DCP could not name both)."""
    root: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split("/")
        node = root
        for name in parents:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ExportError(f"tensor {key!r}: {name!r} is a tensor too; DCP cannot "
                                  f"hold both")
        if leaf in node:
            raise ExportError(f"tensor {key!r} is also the prefix of other tensors; DCP "
                              f"cannot hold both")
        node[leaf] = value
    return root


def write_dcp(items: list[Any], out: Path, scratch: Path, rep: Reporter, copy: Copier,
              meta: dict[str, str]) -> None:
    """A DCP directory ``out`` (new) of ``items``, nested at ``/``, plus ``ftkit.json``."""
    import torch.distributed.checkpoint as dcp
    state = nest(tensors(items, scratch, rep, copy))
    out.mkdir()
    writer = dcp.FileSystemWriter(str(out), single_file_per_rank=True, sync_files=True)
    dcp.save(state, storage_writer=writer, no_dist=True)
    rep.progress(nbytes=0)
    (out / DCP_META).write_text(json.dumps(meta, indent=1) + "\n")
