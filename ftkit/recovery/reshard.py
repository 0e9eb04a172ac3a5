"""Restore a PFS step on another DP x TP x PP layout (resharding).

A step saved with declared shards (:mod:`ftkit.capture.shards`: ``declare_shard``, DTensor
placements; optimizer state keyed by its parameter) can be loaded by a job of another
layout of the same model. Every rank reads the verified metadata of every saved rank's group
(no tensor data) into a :class:`Catalog` — for each *global name* (a tensor's key, else its
path: a pipeline stage stores its layers under their global names) the saved boxes of the
global tensor and who holds each — then builds its own state tree from its live state:

* tensors of modules (parameters, buffers) and every declared shard: the chunks this rank
  holds now, filled from the saved chunks that intersect them (:mod:`ftkit.recovery.boxes`);
  an undeclared tensor is whole, and its saved copies must be equal (checked by checksum);
* optimizer state: for each live parameter, the saved state of the same parameter (found by
  key), each state tensor of the parameter's global shape cut like the live parameter, the
  others (Adam's ``step``) whole; ``param_groups`` from the template rank, with the live
  parameter numbering;
* everything else (RNG state, loader positions, counters, undeclared tensors outside
  modules): the value the *template* rank had — the saved rank at coordinates
  (dp mod saved dp, tp mod saved tp, pp mod saved pp), so a pure DP change behaves like
  the DP-only path (:func:`ftkit.recovery.pfs_restore.source_rank`).

Each saved tensor a rank needs is read once and checked: whole against its checksum, or,
when it records block checksums (rank files, tensors of several 4 MiB blocks) and the rank
needs only some of its blocks, just those blocks, each against its own checksum. A tensor
that fits as it is lands straight in its destination. Local: the caller agrees on
the outcome (:func:`ftkit.recovery.pfs_restore.restore_from_pfs`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ftkit.buffers import aligned_empty
from ftkit.capture import attached, shards
from ftkit.capture.flatten import (
    TensorLeaf,
    dtensor_type,
    flatten,
    itemsize,
    leaf_from_bytes,
    reserved,
    unflatten,
)
from ftkit.capture.inplace import Reading, _as_live, destination
from ftkit.capture.landing import Gate, GatedLanding
from ftkit.capture.rng import rank_local_indices
from ftkit.capture.shards import Chunk, ShardSpec
from ftkit.errors import CheckpointError
from ftkit.recovery import boxes
from ftkit.recovery.boxes import Copy, Source
from ftkit.storage.pfs.h5group import RankGroup
from ftkit.storage.pfs.h5read import StepReader

Node = dict[str, Any]


def saved_layout(meta: dict[str, Any]) -> tuple[int, int, int]:
    """(dp, tp, pp) of a PFS step from its verified index attributes."""
    world, tp, pp = int(meta["world"]), int(meta["tp"]), int(meta["pp"])
    return world // (tp * pp), tp, pp


def declared(groups: dict[int, RankGroup]) -> bool:
    """Whether a step describes its shards (any tensor with a shard spec or a key)."""
    return any(e["shard"] is not None or e["key"] is not None
               for g in groups.values() for e in g.entries)


def template_rank(saved: tuple[int, int, int], coords: Any) -> int:
    """The saved rank whose rank-local state (RNG, loader positions, ...) the rank at
    ``coords`` (dp, tp, pp) continues: (dp mod saved dp, tp mod saved tp, pp mod saved pp)."""
    dp, tp, pp = saved
    return (coords.pp % pp) * dp * tp + (coords.dp % dp) * tp + coords.tp % tp


@dataclasses.dataclass
class Global:
    """One global tensor of the saved step: its type, shape and saved boxes (identical
    boxes merged: the replicas of a box are alternatives)."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    boxes: dict[Chunk, list[Source]] = dataclasses.field(default_factory=dict)


def spec_of(entry: dict[str, Any]) -> ShardSpec:
    """The cut of a saved tensor (an entry of a verified rank group); whole when it has
    none."""
    shard = entry["shard"]
    if shard is None:
        return boxes.whole(entry["shape"])
    return shards.make_spec(shard["global_shape"], [tuple(c) for c in shard["chunks"]])


class Catalog:
    """Every saved rank's tensors by global name (rank-local RNG state left out), and where
    each optimizer's state of each parameter lies. CheckpointError when the saved ranks
    disagree about a tensor."""

    def __init__(self, groups: dict[int, RankGroup], step: int) -> None:
        self.groups, self.step = groups, step
        self.tensors: dict[str, Global] = {}
        self.param_state: dict[tuple[str, str], tuple[int, int]] = {}
        sums: dict[tuple[str, str], tuple[int, str]] = {}
        for rank, group in sorted(groups.items()):
            skip = rank_local_indices(group.tree)
            for e in group.entries:
                if e["index"] not in skip:
                    self._add(rank, e, sums)
        for name, g in self.tensors.items():
            try:
                boxes.check_boxes(name, list(g.boxes))
            except ValueError as exc:
                raise self.error(str(exc)) from None

    def error(self, why: str) -> CheckpointError:
        return CheckpointError(self.step, {}, message=f"cannot reshard step {self.step}: {why}")

    def _add(self, rank: int, e: dict[str, Any], sums: dict[tuple[str, str], tuple[int, str]]
             ) -> None:
        name = e["key"] or e["path"]
        spec = spec_of(e)
        g = self.tensors.setdefault(name, Global(e["kind"], e["dtype"], spec.global_shape))
        if (g.kind, g.dtype, g.shape) != (e["kind"], e["dtype"], spec.global_shape):
            raise self.error(f"tensor {name!r} is {g.kind} {g.dtype} {list(g.shape)} on one "
                             f"saved rank and {e['kind']} {e['dtype']} "
                             f"{list(spec.global_shape)} on rank {rank}")
        replica = (name, repr(spec.to_json()["chunks"]))
        first = sums.setdefault(replica, (rank, e["checksum"]))
        if first[1] != e["checksum"]:
            raise self.error(
                f"tensor {name!r} is held as the same piece by ranks {first[0]} and {rank} "
                f"with different contents (an undeclared shard, e.g. ZeRO-sharded optimizer "
                f"state?): declare it with ftkit.declare_shard, or restore with the saved "
                f"layout")
        start = 0
        for box in spec.chunks:
            g.boxes.setdefault(box, []).append(Source(rank, e["index"], start, box))
            start += box.numel
        if e["key"] is not None:
            self._param_state(rank, e)

    def _param_state(self, rank: int, e: dict[str, Any]) -> None:
        """Record which saved index holds a parameter's optimizer state: the entry's path
        is ``<opt>/state/<i>/<name>``, its key ``<opt>/state/<param path>/<name>``."""
        head, _, name = e["path"].rpartition("/")
        prefix, _, index = head.rpartition("/")
        key = e["key"]
        if not (index.isdecimal() and prefix.endswith("state") and key.endswith("/" + name)
                and key.startswith(prefix + "/")):
            return
        param = key[len(prefix) + 1:-len(name) - 1]
        self.param_state.setdefault((prefix, param), (rank, int(index)))


def paths_of(tree: Node, path: str = "") -> Iterator[tuple[str, Node]]:
    """(path, node) of every node of a skeleton, in flatten's path spelling (an object's
    state shares its path)."""
    if tree.get("t") == "obj":
        yield from paths_of(tree["v"], path)
        return
    yield path, tree
    if tree.get("t") == "dict":
        for key, node in tree["items"]:
            yield from paths_of(node, f"{path}/{key}" if path else str(key))
    elif tree.get("t") in ("list", "tuple"):
        for i, node in enumerate(tree["items"]):
            yield from paths_of(node, f"{path}/{i}")


@dataclasses.dataclass
class Target:
    """A tensor of the rank's new state: filled from a global tensor (``name``, cut as
    ``spec``) or, with ``name`` None, the template rank's tensor ``index`` as it is."""

    leaf: TensorLeaf
    live: TensorLeaf | None
    name: str | None = None
    spec: ShardSpec | None = None
    index: int = -1
    like: TensorLeaf | None = None    # optimizer state: its DTensor parameter's leaf


def _is_dtensor(t: Any) -> bool:
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


class _Builder:
    """Builds the rank's new skeleton from its live one (see the module docstring)."""

    def __init__(self, catalog: Catalog, template: int, state: Any) -> None:
        self.catalog, self.template = catalog, template
        self.skel, self.live = flatten(state, attached.extra_layout)
        self.specs, self.keys = shards.specs_and_keys(state, self.live)
        objects = list(shards.objects_of(state))
        self.modules = [p for p, o in objects if hasattr(o, "named_parameters")]
        self.optimizers = {p: o for p, o in objects if hasattr(o, "param_groups")}
        self.params = shards.param_paths(state)
        self.saved: dict[int, dict[str, Node]] = {}
        self.targets: list[Target] = []

    def nodes(self, rank: int) -> dict[str, Node]:
        if rank not in self.saved:
            self.saved[rank] = dict(paths_of(self.catalog.groups[rank].tree))
        return self.saved[rank]

    def build(self) -> Node:
        return self._node(self.skel, "")

    def _node(self, node: Node, path: str) -> Node:
        kind = node.get("t")
        if kind == "obj":
            if path in self.optimizers:
                return {"t": "obj", "v": self._optimizer(node["v"], path)}
            return {"t": "obj", "v": self._node(node["v"], path)}
        if kind == "dict":
            return {"t": "dict", "items": [[k, self._node(v, f"{path}/{k}" if path else str(k))]
                                           for k, v in node["items"]]}
        if kind in ("list", "tuple"):
            return {"t": kind, "items": [self._node(v, f"{path}/{i}")
                                         for i, v in enumerate(node["items"])]}
        if kind == "tensor":
            return self._tensor(node, path)
        old = self.nodes(self.template).get(path)       # a plain value: the template's
        return old if old is not None and old.get("t") in ("v", "f") else node

    def _add(self, target: Target, scalar: bool = False) -> Node:
        self.targets.append(target)
        out: Node = {"t": "tensor", "i": len(self.targets) - 1}
        if scalar:
            out["scalar"] = True
        return out

    def _tensor(self, node: Node, path: str) -> Node:
        i = int(node["i"])
        live = self.live[i]
        if (any(path.startswith(m + "/") for m in self.modules) or i in self.specs) and \
                not reserved(path):
            spec = self.specs.get(i) or boxes.whole(live.shape)
            return self._add(Target(self._plain(live), live, self.keys.get(i) or path, spec),
                             bool(node.get("scalar")))
        old = self.nodes(self.template).get(path)
        if old is None or old.get("t") != "tensor":
            raise self.catalog.error(f"{path}: in the state but not in the checkpoint of "
                                     f"saved rank {self.template}")
        e = self.catalog.groups[self.template].entries[int(old["i"])]
        leaf = TensorLeaf(path, e["kind"], e["dtype"], tuple(e["shape"]), e["nbytes"])
        return self._add(Target(leaf, live, index=int(old["i"])), bool(old.get("scalar")))

    @staticmethod
    def _plain(leaf: TensorLeaf) -> TensorLeaf:
        return TensorLeaf(leaf.path, leaf.kind, leaf.dtype, tuple(leaf.shape), leaf.nbytes)

    def _optimizer(self, node: Node, where: str) -> Node:
        """The optimizer's state dict: per-parameter state by key, ``param_groups`` from
        the template rank with the live numbering."""
        opt = self.optimizers[where]
        prefix = f"{where}/state" if where else "state"
        items = []
        for key, value in node["items"]:
            if key == "state":
                value = self._param_states(opt, prefix)
            elif key == "param_groups":
                value = self._groups(value, f"{where}/param_groups" if where else "param_groups")
            else:
                value = self._node(value, f"{where}/{key}" if where else str(key))
            items.append([key, value])
        return {"t": "dict", "items": items}

    def _param_states(self, opt: Any, prefix: str) -> Node:
        items = []
        live_params = [p for group in opt.param_groups for p in group["params"]]
        for i, p in enumerate(live_params):
            owner = self.params.get(id(p))
            if owner is None:
                raise self.catalog.error(f"{prefix}: parameter {i} of the optimizer belongs "
                                         f"to no module of the state, so its saved state "
                                         f"cannot be found on another layout")
            found = self.catalog.param_state.get((prefix, owner[0]))
            if found is None:
                continue                     # no saved state: the parameter never stepped
            rank, index = found
            saved = self.nodes(rank).get(f"{prefix}/{index}")
            if saved is None or saved.get("t") != "dict":
                raise self.catalog.error(f"{prefix}/{index} of saved rank {rank} is not a "
                                         f"dict of state")
            entries = [[name, self._param_tensor(sub, rank, p, owner[1], f"{prefix}/{i}/{name}")
                        if sub.get("t") == "tensor" else sub] for name, sub in saved["items"]]
            items.append([i, {"t": "dict", "items": entries}])
        return {"t": "dict", "items": items}

    def _param_tensor(self, node: Node, rank: int, param: Any, spec: ShardSpec | None,
                      path: str) -> Node:
        """A state tensor of ``param``: cut like the parameter when it has the parameter's
        global shape (a DTensor like it, for a DTensor parameter), else whole."""
        e = self.catalog.groups[rank].entries[int(node["i"])]
        name = e["key"] or e["path"]
        g = self.catalog.tensors[name]
        holder = param if _is_dtensor(param) else None
        local = param.detach().to_local() if holder is not None else param
        pspec = shards.dtensor_spec(param) if holder is not None else \
            spec or boxes.whole(param.shape)
        cut = pspec if g.shape == pspec.global_shape else boxes.whole(g.shape)
        shape = tuple(local.shape) if cut is pspec else g.shape
        nbytes = boxes.numel(shape) * itemsize(g.kind, g.dtype)
        leaf = TensorLeaf(path, g.kind, g.dtype, shape, nbytes)
        like = TensorLeaf(path, g.kind, g.dtype, shape, nbytes, holder=holder) \
            if holder is not None and cut is pspec else None
        return self._add(Target(leaf, None, name, cut, like=like), bool(node.get("scalar")))

    def _groups(self, live: Node, path: str) -> Node:
        saved = self.nodes(self.template).get(path)
        if saved is None or saved.get("t") != "list" or len(saved["items"]) != len(
                live.get("items", [])):
            raise self.catalog.error(f"{path}: the optimizer has {len(live.get('items', []))} "
                                     f"parameter groups, saved rank {self.template} another "
                                     f"number")
        out = []
        for mine, theirs in zip(live["items"], saved["items"]):
            params = dict(mine["items"]).get("params")
            out.append({"t": "dict", "items": [[k, params if k == "params" else v]
                                               for k, v in theirs["items"]]})
        return {"t": "list", "items": out}


class Resharded:
    """A PFS step opened to be loaded on another layout by one rank: the catalog, the new
    state tree over its destinations and the copies that fill them (nothing read yet).
    The same interface as the direct path (``reader``, ``reading``, :meth:`read`)."""

    def __init__(self, reader: StepReader, groups: dict[int, RankGroup], topo: Any,
                 state: Any, step: int) -> None:
        self.reader, self.groups, self.step = reader, groups, step
        self.template = template_rank(saved_layout(reader.meta), topo.coords)
        catalog = Catalog(groups, step)
        builder = _Builder(catalog, self.template, state)
        skel = builder.build()
        self.targets = builder.targets
        self.dests: list[Any] = []
        live_flags, tensors = [], []
        for t in self.targets:
            dest, held = destination(t.leaf, t.live)
            if not isinstance(dest, np.ndarray):     # a GPU tensor: assembled on the host
                dest, held = aligned_empty(t.leaf.nbytes), None
            self.dests.append(dest)
            live_flags.append(held is not None)
            tensors.append(held if held is not None else
                           _as_live(leaf_from_bytes(t.leaf, dest), t.live or t.like))
        self.copies = self._plan(catalog, topo.rank)
        self.reading = Reading(self.dests, live_flags, unflatten(skel, tensors))

    def _plan(self, catalog: Catalog, rank: int) -> dict[tuple[int, int], list[tuple[int, Copy]]]:
        """The copies of every target, grouped by the saved tensor they read."""
        out: dict[tuple[int, int], list[tuple[int, Copy]]] = {}
        for j, t in enumerate(self.targets):
            if t.name is None:
                source = Source(self.template, t.index, 0, boxes.whole(t.leaf.shape).chunks[0])
                out.setdefault((self.template, t.index), []).append(
                    (j, Copy(source, source.box, source.box, 0)))
                continue
            g = catalog.tensors.get(t.name)
            assert t.spec is not None
            if g is None:
                raise catalog.error(f"{t.name}: in the state ({t.leaf.dtype} "
                                    f"{list(t.spec.global_shape)}) but not in the checkpoint")
            if (g.kind, g.dtype, g.shape) != (t.leaf.kind, t.leaf.dtype, t.spec.global_shape):
                raise catalog.error(f"{t.name}: the checkpoint has {g.dtype} {list(g.shape)}, "
                                    f"the state {t.leaf.dtype} {list(t.spec.global_shape)}")
            try:
                copies = boxes.plan(t.name, t.spec, g.boxes, rank)
            except ValueError as exc:
                raise catalog.error(str(exc)) from None
            for c in copies:
                out.setdefault((c.source.rank, c.source.index), []).append((j, c))
        return out

    def _read_part(self, group: RankGroup, index: int, copies: list[Copy], size: int,
                   raw: np.ndarray) -> bool:
        """Only the blocks of saved tensor ``index`` that ``copies`` read, into their places
        of ``raw``, each checked (:meth:`StepReader.read_blocks`); False when the tensor
        records no blocks or every block is needed (then it is read whole)."""
        entry = group.entries[index]
        if not entry["blocks"]:
            return False
        need = boxes.blocks_needed([boxes.byte_span(c, size) for c in copies],
                                   entry["blocks"][0], entry["nbytes"])
        return need is not None and self.reader.read_blocks(group, index, need, raw)

    def read(self, gate: Gate, progress: Callable[[int], None]) -> None:
        """Read every saved tensor this rank needs once (checksum checked) and copy its
        boxes into the destinations, live ones through ``gate``; raises on any problem."""
        landing = GatedLanding(gate)
        try:
            for (rank, index), uses in sorted(self.copies.items()):
                group = self.groups[rank]
                entry = group.entries[index]
                progress(entry["nbytes"])
                j, c = uses[0]
                t = self.targets[j]
                if len(uses) == 1 and boxes.direct([c], t.spec or boxes.whole(t.leaf.shape),
                                                   boxes.numel(entry["shape"])):
                    landing.start(self.dests[j], self.reading.live[j])
                    self.reader.read_tensor(group, index, landing)
                else:
                    raw = aligned_empty(entry["nbytes"])
                    size = itemsize(entry["kind"], entry["dtype"])
                    if not self._read_part(group, index, [c for _, c in uses], size, raw):
                        landing.start(raw, False)
                        self.reader.read_tensor(group, index, landing)
                    for j, c in uses:
                        with gate.passage():
                            boxes.copy(c, raw, self.dests[j], size)
                progress(0)
        finally:
            landing.finish()
