"""Seed a job that has no checkpoint yet from a torch DCP checkpoint
(``Checkpointer.restore(state, init_from=DIR)``), resharded to the job's layout.

Every torch tensor of the live state is looked up by its global name — its key (declared
shards, optimizer state by parameter: :mod:`ftkit.capture.shards`), else its state path —
with ``/`` read as ``.``: ``model/blocks.0.w`` is DCP's ``model.blocks.0.w``, what
``dcp.save({"model": model.state_dict()}, ...)`` writes and what ``ftkit export --format
dcp`` writes. The rank's part of it (its declared chunks, DTensor placements, else the whole
tensor) is copied from the saved chunks that intersect it, each read once
(:mod:`ftkit.interop.dcp`: allowlisted metadata, ``weights_only`` data), straight into the
live tensor. Every parameter and buffer of the state's modules must be found, with the
state's dtype and global shape; other tensors (optimizer state that exists already, ...)
are seeded when DCP has them and left as they are otherwise. RNG states are never seeded.
:func:`seed` is local; :func:`seed_everywhere` agrees on its outcome.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ftkit.capture import attached, shards
from ftkit.capture.flatten import flatten
from ftkit.capture.rng import rank_local_indices
from ftkit.capture.shards import ShardSpec
from ftkit.comm.dist import DistComm, describe
from ftkit.errors import FtkitError, UnrecoverableError
from ftkit.interop.dcp import DcpTensor, read_metadata, read_piece
from ftkit.recovery import boxes

log = logging.getLogger("ftkit.checkpointer")


@dataclasses.dataclass(frozen=True)
class Target:
    """A live tensor to seed: DCP name, the local torch tensor, its chunks, and whether it
    must be found (a module's parameter or buffer)."""

    fqn: str
    tensor: Any
    spec: ShardSpec
    required: bool


def targets(state: Any) -> list[Target]:
    """The seedable tensors of ``state`` (torch, not RNG state), in flatten order."""
    skel, live = flatten(state, attached.extra_layout)
    specs, keys = shards.specs_and_keys(state, live)
    modules = [p for p, o in shards.objects_of(state) if hasattr(o, "named_parameters")]
    skip = rank_local_indices(skel)
    out = []
    for i, leaf in enumerate(live):
        if leaf.kind != "torch" or i in skip:
            continue
        name = keys.get(i) or leaf.path
        out.append(Target(name.replace("/", "."), leaf.source,
                          specs.get(i) or boxes.whole(leaf.shape),
                          any(leaf.path.startswith(m + "/") for m in modules)))
    return out


def seed(path: Path, state: Any) -> dict[str, Any]:
    """Fill ``state`` from DCP directory ``path``; a summary (``tensors`` seeded,
    ``missing``: optional tensors DCP lacks, ``unused``: DCP tensors this rank did not
    need). UnrecoverableError naming the tensor when a required one is missing or does not
    match; CorruptCheckpointError for a damaged directory."""
    saved = read_metadata(path)
    todo = targets(state)
    missing = [t for t in todo if t.fqn not in saved]
    required = [t.fqn for t in missing if t.required]
    if required:
        raise UnrecoverableError(
            f"cannot seed from DCP checkpoint {path}: it has no {', '.join(required[:5])}"
            + (f" (and {len(required) - 5} more)" if len(required) > 5 else "")
            + f"; it holds {', '.join(sorted(saved)[:5]) or 'no tensor'}"
            + (" ..." if len(saved) > 5 else ""))
    used = set()
    for t in todo:
        if t.fqn in saved:
            _fill(path, saved[t.fqn], t)
            used.add(t.fqn)
    return {"tensors": len(used), "missing": sorted(t.fqn for t in missing),
            "unused": sorted(set(saved) - used)}


def seed_everywhere(dc: DistComm, path: Path, state: Any, emit: Callable[..., None]
                   ) -> None:
    """Seed ``state`` from DCP ``path`` on every rank (:func:`seed`); the same
    UnrecoverableError everywhere when any rank cannot; a ``seed`` event (``emit``) when
    done. All ranks of ``dc`` call."""
    t0 = time.monotonic()
    done: dict[str, Any] = {}
    failure = None
    try:
        done = seed(path, state)
    except FtkitError as exc:
        failure = str(exc)
    except Exception as exc:  # noqa: BLE001 - agreed below, like an FtkitError
        failure = f"cannot seed from DCP checkpoint {path}: {describe(exc)}"
    failures = dc.agree(failure, "seed", 0)
    if failures:
        rank, why = min(failures.items())
        raise UnrecoverableError(f"rank {rank}: {why}" if len(failures) == 1 else
                                 f"rank {rank} (and {len(failures) - 1} more): {why}")
    emit("seed", dir=str(path), tensors=done["tensors"], missing=done["missing"],
         unused=done["unused"][:50], seconds=round(time.monotonic() - t0, 6))
    log.info("seeded %d tensors from DCP checkpoint %s", done["tensors"], path)


def _fill(path: Path, g: DcpTensor, t: Target) -> None:
    """Copy ``t``'s chunks from the pieces of ``g`` that intersect them."""
    import torch
    if (g.dtype, g.shape) != (t.tensor.dtype, t.spec.global_shape):
        raise UnrecoverableError(
            f"cannot seed from DCP checkpoint {path}: {t.fqn} is {g.dtype} {list(g.shape)} "
            f"there, {t.tensor.dtype} {list(t.spec.global_shape)} in the state")
    if not t.tensor.is_contiguous():
        raise UnrecoverableError(f"cannot seed {t.fqn} from DCP: the live tensor is not "
                                 f"contiguous")
    flat = t.tensor.detach().view(-1)
    for piece in g.pieces:
        src = None
        start = 0
        for box in t.spec.chunks:
            inter = boxes.intersect(box, piece.box)
            if inter is not None:
                src = read_piece(path, g, piece) if src is None else src
                dst = flat[start:start + box.numel].view(box.sizes)
                with torch.no_grad():
                    dst[boxes.window(inter, box)].copy_(src[boxes.window(inter, piece.box)])
            start += box.numel

