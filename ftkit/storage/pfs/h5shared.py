"""One shared HDF5 file per PFS step: rank 0 writes its metadata, every rank its own bytes.

The opt-in alternative (``FTKIT_PFS_FILES=shared``) to one file per rank: on a parallel file
system a step of thousands of ranks is then one file instead of thousands, the layout HPC
sites and ``h5py``/``h5dump`` users expect of "one checkpoint". ``step-<s>/ranks.h5`` holds
every rank's ``/rank/<r>`` group exactly as a rank file holds its own (same attributes, seals,
checksums), so readers need nothing new but the name; the index links each ``/rank/<r>`` to
it. Any h5py writes and reads it: parallel h5py (``mpio``) is not used (docs/formats.md says
why: a full file system crashed it).

How it is written (:func:`write_shared_file`, all ranks of the PFS level's communicator):

1. rank 0 gathers every rank's shard header (tensor names, dtypes, shapes, checksums; no
   data) — or the reason a rank could not open its shard;
2. rank 0 creates the file under a new temp name through the same writer as a rank file
   (:func:`ftkit.storage.pfs.hdf5.write_temp`: a full or failing file system is an ordinary
   error): every rank's group and datasets (contiguous, space allocated at once,
   never filled by libhdf5) with their attributes and seals; fsync. It takes the file's
   digest now (only tensor bytes are written later, and the digest leaves them out), and
   broadcasts the temp name and each rank's offsets — or the failure, which every rank
   then raises alike;
3. each rank writes its own tensors' bytes at its offsets, straight from its mapped
   node-local shard, hashed on the way exactly as for a rank file
   (:func:`ftkit.storage.pfs.hdf5.fill_tensor`: ``O_DIRECT`` where possible), then fsyncs;
4. after the flush's agreement that every rank is done, rank 0 renames the file into place
   (:func:`publish`), before the index and ``COMMITTED``.

Every exchange is a :class:`~ftkit.comm.dist.DistComm` collective with its deadline. Rank 0
creates all ranks' objects alone, which at thousands of ranks takes seconds that rank files
spread over the ranks: the price of one file.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
from pathlib import Path
from typing import Any

from ftkit.comm.dist import DistComm
from ftkit.fs import rename_into_place
from ftkit.storage.pfs import h5files, hdf5
from ftkit.storage.pfs.h5sink import H5Sink, named, reopen_direct
from ftkit.storage.shard import Shard

#: the name of the shared file in a step directory
SHARED_FILE = h5files.SHARED_FILE


@dataclasses.dataclass(frozen=True)
class Part:
    """What one rank wrote of a shared file."""

    temp: Path                      # the file, under its temp name until :func:`publish`
    offsets: list[int | None]       # where this rank's tensors' bytes are (None: no bytes)
    digest: dict[str, Any]          # the file's digest (``h5files.file_digest``)


def write_shared_file(step_dir: Path, dc: DistComm, shard: Shard | None,
                      topology: dict[str, Any], step: int, *, failure: str | None = None
                      ) -> Part:
    """Write this rank's part of ``step_dir``'s shared file under its temp name (module
    doc, steps 1-3). All ranks of ``dc`` call, each with its own node-local ``shard`` — or
    None and the ``failure`` that kept it from opening it. Returns what it wrote. Raises
    the same RuntimeError on every rank when a shard could not be opened or rank 0 could
    not create the file; CorruptCheckpointError when this rank's shard does not match its
    checksums, OSError when the file system fails writing its bytes. (Every rank receives
    every rank's offsets: a scatter would send each only its own.)"""
    own = {"failure": failure} if shard is None else \
        {"header": header_of(shard.header), "topology": topology}
    parts = dc.gather(own, "flush", step)
    made: dict[str, Any] = {}
    if parts is not None:
        made = _create(step_dir, parts)
    made = dc.bcast(made, "flush", step)
    if "failure" in made:
        raise RuntimeError(made["failure"])
    assert shard is not None
    part = Part(step_dir / made["temp"], made["offsets"][dc.rank], made["digest"])
    fill_rank(part.temp, shard, part.offsets)
    return part


def _create(step_dir: Path, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0: the new file's temp name, digest and every rank's offsets, or ``{"failure"}``
    naming what went wrong (a rank's shard, or the file system under rank 0)."""
    failed = {r: p["failure"] for r, p in enumerate(parts) if "failure" in p}
    if failed:
        return {"failure": "cannot write the shared file: " + "; ".join(
            f"rank {r}: {why}" for r, why in sorted(failed.items()))}
    try:
        temp, offsets, digest = create_layout(step_dir / SHARED_FILE, parts)
    except Exception as exc:  # noqa: BLE001 - every rank raises it after the broadcast
        return {"failure": f"rank 0: creating the shared file: {type(exc).__name__}: {exc}"}
    return {"temp": temp.name, "offsets": offsets, "digest": digest}


def header_of(header: dict[str, Any]) -> dict[str, Any]:
    """What rank 0 needs of a shard's header to create its group (no shard offsets: they
    are the shard's business)."""
    keep = ("path", "dtype", "shape", "kind", "nbytes", "checksum")
    return {"rank": header["rank"], "step": header["step"], "world": header["world"],
            "job": header["job"], "tree": header["tree"],
            "tensors": [{k: t[k] for k in keep} for t in header["tensors"]]}


def create_layout(path: Path, parts: list[dict[str, Any]]
                  ) -> tuple[Path, list[list[int | None]], dict[str, Any]]:
    """Create a temp file beside ``path`` with every rank's group (``parts``: header and
    topology per rank, in rank order) of unfilled datasets, attributes and seals, fsynced
    (:func:`hdf5.write_temp`). Returns the temp path, per rank the offset of each of its
    tensors' bytes (None: none), and the file's digest (the tensors' bytes, written later,
    are outside it). Raises (and removes the temp file) when the file system fails."""
    offsets: list[list[int | None]] = []

    def fill(h5: Any, _sink: H5Sink) -> None:
        h5.attrs["format"] = hdf5.FORMAT
        for part in parts:
            offsets.append(_create_group(h5, part["header"], part["topology"]))
    temp, digest = hdf5.write_temp(path, fill)
    return temp, offsets, digest


def _create_group(h5: Any, header: dict[str, Any], topology: dict[str, Any]
                  ) -> list[int | None]:
    """One rank's sealed group of unfilled datasets; the offsets of its tensors' bytes."""
    grp = hdf5.create_rank_group(h5, header, topology)
    offsets: list[int | None] = []
    for i, name in enumerate(hdf5.dataset_names(header["tensors"])):
        t = header["tensors"][i]
        ds = hdf5.create_unfilled(grp, name, t)
        ds.attrs.update(hdf5.tensor_attrs(header, i))
        offsets.append(int(ds.id.get_offset()) if t["nbytes"] else None)
    hdf5.seal(grp)
    return offsets


def fill_rank(path: Path, shard: Shard, offsets: list[int | None]) -> None:
    """Write every tensor of ``shard`` at its offset in ``path`` (checked against its
    checksum on the way), then fsync: this rank's bytes are durable on return. Local."""
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    sink = H5Sink(fd, reopen_direct(fd))
    try:
        with cf.ThreadPoolExecutor(1, thread_name_prefix="ftkit-h5-hash") as hasher:
            for i, offset in enumerate(offsets):      # no offset: no bytes, checksum checked
                hdf5.fill_tensor(shard, i, 0 if offset is None else offset, sink, hasher,
                                 with_blocks=False)
        os.fsync(fd)
    except OSError as exc:
        raise named(exc, str(path)) from exc
    finally:
        sink.close()
        os.close(fd)


def publish(step_dir: Path, temp: str) -> None:
    """Rank 0, once every rank's :func:`write_shared_file` succeeded: rename the shared
    file from its temp name ``temp`` into place, durably (fsync of the directory)."""
    rename_into_place(step_dir / temp, step_dir / SHARED_FILE)
