"""DistributedDataParallel's gradient buckets as checkpoint state: a resumed run reduces alike.

DDP all-reduces gradients bucket by bucket, each bucket one flat buffer. Its first iteration
uses an initial layout (one bucket of every parameter, unless ``find_unused_parameters``); at
the start of the second it *rebuilds* the buckets in the order the first backward made the
gradients ready (bucket 0 small, then up to ``bucket_cap_mb``), and keeps that layout for
good. A process resumed at step s runs step s with the initial layout again, so each gradient
element is reduced at another place of another buffer: with three or more ranks, its sum is
added up in another order, and the run drifts in the last bits from the uninterrupted one.

ftkit therefore saves the layout with the module (``{"ddp_buckets": int64[2, n]}`` beside its
state dict: row 0 the reducer's parameter indices in bucket order, row 1 each one's bucket;
-1 everywhere while DDP still uses its initial layout) and, at restore, gives the DDP a
reducer built with the saved layout, the way DDP's own ``__setstate__`` builds one
(:func:`install`). A DDP is found as a leaf of the state or, for a module leaf, as the DDP
wrapping it (:func:`find`, at ``restore()`` or the first ``save()``).

This uses DDP internals (``_ddp_init_helper``, the reducer's buckets). Where they are missing
or DDP is in a mode ftkit does not rebuild (mixed precision, the Python reducer) and the DDP
rebuilds its buckets, :func:`unsupported` refuses the state before the first step with the
one-line fix (``find_unused_parameters=True``: DDP then never rebuilds).
"""
from __future__ import annotations

import logging
import sys
import weakref
from typing import Any

from ftkit.capture.live import instances
from ftkit.capture.loaders import walk

log = logging.getLogger(__name__)
KEY = "ddp_buckets"
_NEEDED = ("_ddp_init_helper", "_build_params_for_reducer", "_build_debug_param_to_name_mapping",
           "_bucket_config", "_has_rebuilt_buckets")
_FIX = "construct it with DistributedDataParallel(..., find_unused_parameters=True)"


def _ddp_class() -> Any:
    parallel = sys.modules.get("torch.nn.parallel")
    return getattr(parallel, "DistributedDataParallel", None)


class _Known:
    """What ftkit knows of one DDP's layout: the tensor for its reducer ``reducer``;
    ``settled`` once DDP itself rebuilt the buckets (an installed layout is rebuilt once
    more, to the same order, at the next forward)."""

    def __init__(self, reducer: Any, layout: Any, settled: bool) -> None:
        self.reducer, self.layout, self.settled = reducer, layout, settled


#: state leaf (a DDP, or a module a DDP wraps) -> that DDP
_WRAPPER: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()
_KNOWN: weakref.WeakKeyDictionary[Any, _Known] = weakref.WeakKeyDictionary()


def find(state: Any) -> None:
    """Note the DDP of every module leaf of ``state``: the leaf itself, or a live DDP that
    wraps it (one scan of the garbage collector's objects, only when a module leaf is not a
    DDP). Local; call before the first step."""
    cls = _ddp_class()
    torch = sys.modules.get("torch")
    if cls is None or torch is None:
        return
    modules = [v for _, v in walk(state) if isinstance(v, torch.nn.Module)]
    wrapping: dict[int, Any] = {}
    if any(not isinstance(m, cls) for m in modules):
        wrapping = {id(o.module): o for o in instances(cls)}
    for module in modules:
        ddp = module if isinstance(module, cls) else wrapping.get(id(module))
        if ddp is not None:
            _WRAPPER[module] = weakref.ref(ddp)


def ddp_of(obj: Any) -> Any:
    """The DDP :func:`find` noted for state leaf ``obj``, or None."""
    try:
        ref = _WRAPPER.get(obj)
    except TypeError:            # not weak-referenceable: not a module
        return None
    return None if ref is None else ref()


def _rebuilds(ddp: Any) -> bool:
    return bool(ddp.static_graph or not ddp.find_unused_parameters)


def _why_not(ddp: Any) -> str | None:
    """Why ftkit cannot put a layout back into ``ddp`` (None: it can)."""
    missing = [name for name in _NEEDED if not hasattr(ddp, name)]
    if missing or not hasattr(ddp.reducer, "_get_zeros_like_grad_buckets"):
        import torch
        return f"this torch ({torch.__version__}) lacks {missing or ['its reducer buckets']}"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "DDP's mixed_precision"
    if getattr(ddp, "_use_python_reducer", False):
        return "DDP's Python reducer"
    return None


def unsupported(state: Any) -> str | None:
    """One line when a DDP of ``state`` rebuilds its buckets and ftkit cannot put them back
    on resume (so a resumed run would not be bit-exact), else None. Local."""
    for path, value in walk(state):
        ddp = ddp_of(value)
        if ddp is None or not _rebuilds(ddp):
            continue
        why = _why_not(ddp)
        if why is not None:
            return (f"state[{path!r}] is under a DistributedDataParallel whose gradient buckets "
                    f"ftkit cannot restore ({why}): DDP rebuilds them after its first "
                    f"iteration, so a resumed run would sum gradients in another order; "
                    f"{_FIX} (it then never rebuilds them)")
    return None


def _params(ddp: Any) -> list[Any]:
    return list(ddp._build_params_for_reducer()[0])


def _unset(n: int) -> Any:
    import torch
    return torch.full((2, n), -1, dtype=torch.int64)


def _read(ddp: Any, params: list[Any]) -> Any:
    """The reducer's current layout (allocates one zero buffer per bucket, once)."""
    out = _unset(len(params))
    index = {id(p): i for i, p in enumerate(params)}
    col = 0
    for b, bucket in enumerate(ddp.reducer._get_zeros_like_grad_buckets()):
        for p in bucket.parameters():
            out[0, col], out[1, col] = index[id(p)], b
            col += 1
    return out


def layout(ddp: Any) -> Any:
    """``ddp``'s bucket layout as saved (module doc); -1 while it uses its initial one."""
    known = _KNOWN.get(ddp)
    rebuilt = bool(ddp._has_rebuilt_buckets)
    if known is not None and known.reducer is ddp.reducer and known.settled == rebuilt:
        return known.layout
    params = _params(ddp)
    if not rebuilt:
        return _unset(len(params))
    out = _read(ddp, params)
    _KNOWN[ddp] = _Known(ddp.reducer, out, settled=True)
    return out


def extra(obj: Any) -> dict[str, Any] | None:
    """What ftkit saves with state leaf ``obj`` when a DDP is noted for it, else None."""
    ddp = ddp_of(obj)
    if ddp is None or _why_not(ddp) is not None:
        return None
    return {KEY: layout(ddp).clone()}


def extra_layout(obj: Any) -> dict[str, Any] | None:
    """:func:`extra`'s leaves without reading the reducer (restore matches leaves with it)."""
    ddp = ddp_of(obj)
    if ddp is None or _why_not(ddp) is not None:
        return None
    return {KEY: _unset(len(_params(ddp)))}


def load_saved(obj: Any, saved: Any) -> None:
    """Restore: give the DDP of ``obj`` a reducer with the saved layout (or, when the saved
    step still had the initial layout and this DDP has left it, a fresh one). Local, and the
    same on every rank of the DDP's group (they restore the same layout)."""
    ddp = ddp_of(obj)
    value = saved.get(KEY) if isinstance(saved, dict) else None
    if value is None:
        return
    if ddp is None:
        if bool((value >= 0).any()):
            log.warning("a module was saved under a DistributedDataParallel that had rebuilt "
                        "its gradient buckets, and no DDP wrapped it at restore(): wrap the "
                        "model in DDP before restore() so the resumed run sums gradients as "
                        "the uninterrupted one did")
        return
    if _why_not(ddp) is not None:
        return
    params, sparse = (list(x) for x in ddp._build_params_for_reducer())
    buckets = _buckets(value, params)
    if buckets is None:
        log.warning("the saved gradient-bucket layout of a DistributedDataParallel does not "
                    "fit its %d parameters; it keeps its own (a resumed run may differ in the "
                    "last bits)", len(params))
        return
    if buckets or ddp._has_rebuilt_buckets or ddp in _KNOWN:
        install(ddp, buckets, params, sparse)


def _buckets(value: Any, params: list[Any]) -> list[list[int]] | None:
    """The saved layout as lists of parameter indices ([] when it is the initial layout),
    or None when it does not fit ``params``."""
    n = len(params)
    if tuple(value.shape) != (2, n):
        return None
    order, bucket = value[0].tolist(), value[1].tolist()
    if all(v == -1 for v in order + bucket):
        return []
    if sorted(order) != list(range(n)) or bucket != sorted(bucket) or (
            n and (bucket[0] != 0 or len(set(bucket)) != bucket[-1] + 1)):
        return None
    out: list[list[int]] = [[] for _ in range(bucket[-1] + 1 if n else 0)]
    for i, b in zip(order, bucket):
        out[b].append(i)
    for group in out:
        kinds = {(params[i].dtype, params[i].device) for i in group}
        if len(kinds) != 1:
            return None
    return out


def install(ddp: Any, buckets: list[list[int]], params: list[Any], sparse: list[bool]
            ) -> None:
    """Replace ``ddp``'s reducer with one of layout ``buckets`` ([]: DDP's initial layout),
    as DDP's ``__setstate__`` builds one; ``params, sparse``: what
    ``ddp._build_params_for_reducer()`` returned. Local: no collective."""
    import torch.distributed as dist
    names = ddp._build_debug_param_to_name_mapping(params)
    first, cap = ddp._bucket_config.first_bucket_bytes_cap, ddp.bucket_bytes_cap
    limits = [first] + [cap] * (len(buckets) - 1)
    real = dist._compute_bucket_assignment_by_size
    if buckets:          # _ddp_init_helper reverses what this returns
        dist._compute_bucket_assignment_by_size = lambda *_a, **_k: (
            list(reversed(buckets)), list(reversed(limits)))
    ddp.reducer._remove_autograd_hooks()
    try:
        ddp._ddp_init_helper(params, sparse, names, ddp.static_graph)
    finally:
        dist._compute_bucket_assignment_by_size = real
    if ddp.static_graph:
        ddp._static_graph_delay_allreduce_enqueued = False
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    for hook, state in getattr(ddp, "_comm_hooks", []):
        dist._register_comm_hook(ddp.reducer, state, hook)
    ddp._has_rebuilt_buckets = False
    saved = _unset(len(params))
    for col, (b, i) in enumerate((b, i) for b, group in enumerate(buckets) for i in group):
        saved[0, col], saved[1, col] = i, b
    _KNOWN[ddp] = _Known(ddp.reducer, saved, settled=False)
