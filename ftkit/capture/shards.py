"""Declared shards: how one rank's tensor is a piece of a global tensor, and the global names
of optimizer state.

A tensor of a tensor- or pipeline-parallel job is often a slice of a *global* tensor that
no single rank holds. :func:`declare_shard` says which: the global shape and the *chunks*
(boxes of the global tensor, each an offset and a size per dimension) whose elements, each
in C order, one chunk after the other, are the local tensor's elements in C order. One
chunk is the usual slice (Megatron's column- or row-parallel weight); several describe a
fused weight whose local part is several slices (e.g. rank t of a fused ``[q; k; v]`` holds
the t-th slice of each of q, k and v). A tensor without a declaration is whole (a replica,
when several ranks hold it).

Optimizer state follows its parameter: a state tensor of a parameter's shape (Adam's
``exp_avg``, ``exp_avg_sq``) is the same piece of its own global tensor. Its *key* — the
name that identifies it across layouts — is ``<optimizer path>/state/<parameter
path>/<state name>`` when the parameter belongs to a module in the same state
(``optim/state/model/blocks.3.up_w/exp_avg``; its path is ``optim/state/<i>/exp_avg``): a
``torch.optim`` state dict numbers parameters locally (a pipeline stage's first parameter
is 0 on every stage), so its own path cannot say which global tensor it is.

A ``DTensor`` needs no declaration: it is stored as its local tensor, and its placements
say which box of the global tensor that is (``Shard(d)`` cuts dimension d, ``Replicate()``
keeps it whole; a ``Partial`` sum is refused).

:func:`describe` finds both for the flattened leaves of a save; they are stored with the
shard (header keys ``shards`` and ``keys``) and as HDF5 attributes on the PFS level
(:mod:`ftkit.storage.pfs.hdf5`). Local, pure apart from reading the state's objects.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Iterable, Sequence
from typing import Any

from ftkit.capture.flatten import TensorLeaf, dtensor_type

#: the attribute :func:`declare_shard` sets on a tensor
ATTR = "_ftkit_shard"
#: most chunks one declaration may have (a sanity bound for files read back)
MAX_CHUNKS = 1 << 16


@dataclasses.dataclass(frozen=True)
class Chunk:
    """A box of the global tensor: ``offsets`` and ``sizes``, one per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """A local tensor as the concatenation of ``chunks`` of a ``global_shape`` tensor."""

    global_shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def numel(self) -> int:
        return sum(c.numel for c in self.chunks)

    @property
    def dim(self) -> int | None:
        """The one dimension a single-chunk shard is cut along (0 when it is whole), None
        for several chunks or a cut along several dimensions."""
        if len(self.chunks) != 1:
            return None
        cut = [d for d, (n, s) in enumerate(zip(self.global_shape, self.chunks[0].sizes))
               if n != s]
        return cut[0] if len(cut) == 1 else 0 if not cut else None

    def to_json(self) -> dict[str, Any]:
        return {"global_shape": list(self.global_shape),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in self.chunks]}

    @classmethod
    def from_json(cls, obj: Any, numel: int | None = None) -> ShardSpec:
        """Decode :meth:`to_json` (ValueError naming what is wrong); with ``numel``, also
        check that the chunks hold exactly that many elements."""
        if not isinstance(obj, dict) or set(obj) != {"global_shape", "chunks"}:
            raise ValueError(f"shard spec {_short(obj)} is not an object with global_shape "
                             f"and chunks")
        chunks = obj["chunks"]
        if not isinstance(chunks, list) or not all(
                isinstance(c, list) and len(c) == 2 for c in chunks):
            raise ValueError(f"shard chunks {_short(chunks)} are not [offsets, sizes] pairs")
        return make_spec(obj["global_shape"], [(o, s) for o, s in chunks], numel)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _dims(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > 64 or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62
            for v in value):
        raise ValueError(f"{what} {_short(value)} is not a list of at most 64 "
                         f"non-negative integers")
    return tuple(value)


def make_spec(global_shape: Any, chunks: Sequence[tuple[Any, Any]],
              numel: int | None = None) -> ShardSpec:
    """A checked :class:`ShardSpec`: every chunk has one offset and size per dimension and
    lies inside ``global_shape``, chunks do not overlap, and (with ``numel``) they hold
    ``numel`` elements. ValueError naming the problem."""
    gshape = _dims(global_shape, "global_shape")
    if not gshape:
        raise ValueError("a scalar (global shape []) cannot be sharded")
    if not chunks or len(chunks) > MAX_CHUNKS:
        raise ValueError(f"a shard needs 1 to {MAX_CHUNKS} chunks, not {len(chunks)}")
    boxes = []
    for i, (offsets, sizes) in enumerate(chunks):
        box = Chunk(_dims(offsets, f"chunk {i} offsets"), _dims(sizes, f"chunk {i} sizes"))
        if len(box.offsets) != len(gshape) or len(box.sizes) != len(gshape):
            raise ValueError(f"chunk {i} (offsets {list(box.offsets)}, sizes "
                             f"{list(box.sizes)}) does not have the {len(gshape)} dimensions "
                             f"of global shape {list(gshape)}")
        if any(o + s > n for o, s, n in zip(box.offsets, box.sizes, gshape)):
            raise ValueError(f"chunk {i} (offsets {list(box.offsets)}, sizes "
                             f"{list(box.sizes)}) reaches outside global shape {list(gshape)}")
        boxes.append(box)
    overlap = first_overlap(boxes)
    if overlap is not None:
        raise ValueError(f"chunks {overlap[0]} and {overlap[1]} overlap")
    spec = ShardSpec(gshape, tuple(boxes))
    if numel is not None and spec.numel != numel:
        raise ValueError(f"the chunks hold {spec.numel} elements, the tensor {numel}")
    return spec


def first_overlap(boxes: Sequence[Chunk]) -> tuple[int, int] | None:
    """The first pair (i, j), i < j, of ``boxes`` that share an element (empty boxes share
    none), or None."""
    for i, a in enumerate(boxes):
        if a.numel == 0:
            continue
        for j in range(i + 1, len(boxes)):
            b = boxes[j]
            if b.numel and all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in
                               zip(a.offsets, a.sizes, b.offsets, b.sizes)):
                return i, j
    return None


def declare_shard(tensor: Any, global_shape: Sequence[int],
                  offsets: Sequence[int] | None = None, *,
                  chunks: Iterable[tuple[Sequence[int], Sequence[int]]] | None = None) -> Any:
    """Declare that ``tensor`` (a torch tensor or parameter of this rank) is a piece of a
    tensor of ``global_shape``: the box at ``offsets`` with the tensor's own shape, or, with
    ``chunks`` (``[(offsets, sizes), ...]``), those boxes one after the other in C order.
    Returns ``tensor``. The declaration is an attribute of the tensor object: a parameter
    moved by ``module.to()`` keeps it, a new tensor (``t = t.to(device)``) needs its own;
    the optimizer's state for a declared parameter follows it. Local; ValueError when the
    pieces do not fit."""
    if "torch" not in sys.modules or not isinstance(tensor, sys.modules["torch"].Tensor):
        raise TypeError(f"declare_shard needs a torch tensor, not {type(tensor).__name__}")
    if (offsets is None) == (chunks is None):
        raise ValueError("declare_shard takes either offsets or chunks")
    if chunks is None:
        pieces: list[tuple[Any, Any]] = [(tuple(offsets or ()), tuple(tensor.shape))]
    else:
        pieces = [(tuple(o), tuple(s)) for o, s in chunks]
    spec = make_spec(tuple(global_shape), pieces, tensor.numel())
    setattr(tensor, ATTR, spec)
    return tensor


def dtensor_spec(t: Any) -> ShardSpec:
    """The box of a DTensor's global tensor its local tensor holds on this rank (from its
    placements: ``Shard(d)`` cuts, ``Replicate()`` keeps whole). ValueError for placements
    whose local part is not a box (``_StridedShard``)."""
    strided = [p for p in t.placements if type(p).__name__ == "_StridedShard"]
    if strided:
        raise ValueError(f"DTensor placements {tuple(t.placements)}: a strided shard is not "
                         f"one box of the global tensor; ftkit cannot describe it")
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh,
                                                           t.placements)
    return make_spec(tuple(t.shape), [(tuple(offsets), tuple(shape))], math.prod(shape))


def _local(t: Any) -> Any:
    """A DTensor's local tensor (the tensor itself for others)."""
    dtensor = dtensor_type()
    return t.detach().to_local() if dtensor is not None and isinstance(t, dtensor) else t


def _storage_key(t: Any) -> tuple[Any, ...] | None:
    """What a tensor and its detached copies (``state_dict``'s) share: memory, offset,
    shape, strides, dtype and device (None when it has no storage, e.g. a meta tensor).
    A DTensor is identified by its local tensor."""
    t = _local(t)
    try:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                t.stride(), t.dtype, t.device)
    except Exception:  # noqa: BLE001 - no storage to identify it by
        return None


@dataclasses.dataclass
class _Found:
    spec: ShardSpec | None = None
    key: str | None = None


def objects_of(node: Any, path: str = "", depth: int = 0) -> Iterable[tuple[str, Any]]:
    """(path, object) of every object with a ``state_dict`` reachable through plain
    containers, in flatten's path spelling."""
    if depth > 100:
        return
    if hasattr(node, "state_dict") and hasattr(node, "load_state_dict"):
        yield path, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from objects_of(v, f"{path}/{k}" if path else str(k), depth + 1)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from objects_of(v, f"{path}/{i}", depth + 1)


def param_paths(state: Any, objects: list[tuple[str, Any]] | None = None
                ) -> dict[int, tuple[str, ShardSpec | None, Any]]:
    """``id(tensor) -> (path, declared spec or None, tensor)`` of every parameter and
    buffer of the modules in ``state`` (``objects``: :func:`objects_of` of it, when
    known); a tensor shared by several modules keeps its first path."""
    params: dict[int, tuple[str, ShardSpec | None, Any]] = {}
    for path, obj in objects if objects is not None else objects_of(state):
        named = getattr(obj, "named_parameters", None)
        if named is None:
            continue
        for name, p in [*named(), *obj.named_buffers()]:
            params.setdefault(id(p), (f"{path}/{name}" if path else name,
                                      getattr(p, ATTR, None), p))
    return params


def _index(state: Any) -> dict[tuple[Any, ...], _Found]:
    """Declared specs and global keys of the tensors that modules and optimizers in
    ``state`` hold, by storage (:func:`_storage_key`)."""
    found: dict[tuple[Any, ...], _Found] = {}
    objects = list(objects_of(state))
    params = param_paths(state, objects)
    for _, spec, p in params.values():
        key = _storage_key(p) if spec is not None else None
        if key is not None:
            found.setdefault(key, _Found(spec))
    for path, obj in objects:
        if hasattr(obj, "param_groups") and isinstance(getattr(obj, "state", None), dict):
            _optimizer(obj, path, params, found)
    return found


def _optimizer(opt: Any, where: str, params: dict[int, tuple[str, ShardSpec | None, Any]],
               found: dict[tuple[Any, ...], _Found]) -> None:
    """The key (``<where>/state/<parameter path>/<name>``) of every state tensor of the
    optimizer ``opt`` at path ``where`` whose parameter has a path, and the parameter's
    spec for those of its shape."""
    torch = sys.modules["torch"]
    for group in opt.param_groups:
        for p in group.get("params", []):
            owner = params.get(id(p))
            if owner is None:
                continue
            path, spec, _ = owner
            for name, t in opt.state.get(p, {}).items():
                key = _storage_key(t) if isinstance(t, torch.Tensor) else None
                if key is None or key in found:
                    continue
                same = spec is not None and tuple(t.shape) == tuple(p.shape)
                found[key] = _Found(spec if same else None,
                                    f"{where}/state/{path}/{name}" if where else
                                    f"state/{path}/{name}")


def header_table(header: dict[str, Any], name: str) -> dict[str, Any]:
    """A shard header's ``shards`` or ``keys`` table (empty when absent); TypeError when
    it is not a JSON object."""
    value = header.get(name, {})
    if not isinstance(value, dict):
        raise TypeError(f"shard header entry {name!r} is {_short(value)}, not an object")
    return value


def whole(shape: Sequence[int]) -> ShardSpec:
    """The spec of an undeclared tensor: one chunk, all of it (a scalar too)."""
    shape = tuple(int(n) for n in shape)
    return ShardSpec(shape, (Chunk((0,) * len(shape), shape),))


def _cut_text(spec: ShardSpec) -> str:
    if spec.chunks == whole(spec.global_shape).chunks:
        return f"whole {list(spec.global_shape)}"
    boxes = ", ".join(f"{list(c.offsets)}+{list(c.sizes)}" for c in spec.chunks[:3])
    more = f" and {len(spec.chunks) - 3} more" if len(spec.chunks) > 3 else ""
    return f"the box(es) {boxes}{more} of {list(spec.global_shape)}"


def specs_and_keys(state: Any, leaves: list[TensorLeaf]
                   ) -> tuple[dict[int, ShardSpec], dict[int, str]]:
    """:func:`describe`'s ``shards`` and ``keys`` of the live ``state`` (flattened as
    ``leaves``), decoded: ``{index: spec}`` and ``{index: global key}``. Local."""
    found = describe(state, leaves)
    return ({int(i): ShardSpec.from_json(s) for i, s in found.get("shards", {}).items()},
            {int(i): k for i, k in found.get("keys", {}).items()})


def cut_difference(saved: dict[str, ShardSpec | None], state: Any, leaves: list[TensorLeaf]
                   ) -> str | None:
    """Where a checkpoint's cut of its tensors differs from the live ``state``'s (flattened
    as ``leaves``): ``saved`` maps the path of every tensor of the checkpoint to its
    declared spec (None: whole). Tensors are matched by path (a fresh optimizer has no state
    yet: the leaves need not line up), live ones the checkpoint lacks are not compared. The
    first tensor whose piece is another part of its global tensor, in words (the local
    shapes may still agree: a 2 x 2 mesh with its placements swapped), else None. Local."""
    live = specs_and_keys(state, leaves)[0]
    for i, leaf in enumerate(leaves):
        if leaf.kind != "torch" or leaf.path not in saved:
            continue
        mine = live.get(i) or whole(leaf.shape)
        theirs = saved[leaf.path] or whole(leaf.shape)
        if mine != theirs:
            return (f"{leaf.path} holds {_cut_text(theirs)} in the checkpoint but "
                    f"{_cut_text(mine)} in the state")
    return None


def describe(state: Any, leaves: list[TensorLeaf]) -> dict[str, Any]:
    """The ``shards`` (``{index: spec json}``) and ``keys`` (``{index: global key}``) of the
    flattened ``leaves`` of ``state`` that have them, as shard header entries (only the
    non-empty ones). Local."""
    if "torch" not in sys.modules or not any(leaf.kind == "torch" for leaf in leaves):
        return {}
    found = _index(state)
    shards, keys = {}, {}
    for i, leaf in enumerate(leaves):
        if leaf.kind != "torch":
            continue
        spec = dtensor_spec(leaf.holder) if leaf.holder is not None else \
            getattr(leaf.source, ATTR, None)
        where = _storage_key(leaf.source) if found else None
        hit = found.get(where) if where is not None else None
        if spec is None and hit is not None:
            spec = hit.spec
        if spec is not None:
            numel = math.prod(leaf.shape)
            if spec.numel != numel:
                raise ValueError(f"{leaf.path}: declared as a shard of {spec.numel} elements "
                                 f"of a {list(spec.global_shape)} tensor, but it has {numel} "
                                 f"now (declare_shard again after resizing it)")
            shards[str(i)] = spec.to_json()
        if hit is not None and hit.key is not None:
            keys[str(i)] = hit.key
    return {k: v for k, v in (("shards", shards), ("keys", keys)) if v}
