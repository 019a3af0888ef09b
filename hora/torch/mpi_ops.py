"""Horovod's torch collectives (``horovod.torch.mpi_ops``) on hora's engine.

Every function here only checks its arguments, wraps tensors into a
:class:`~hora.core.request.Request` and hands it to the engine; the
synchronous forms wait on the handle.  Async forms return an integer handle
for :func:`poll` and :func:`synchronize`, as Horovod does.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hora.core import runtime
from hora.core.ops import CollectiveType, ReduceOp
from hora.core.request import Entry, Handle, Request
from hora.core.runtime import ProcessSet, global_process_set
from hora.errors import ConfigError, HoraError, UnsupportedError

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

_SUPPORTED = {
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool,
}

# Horovod hands out integer handles; keep the mapping to engine handles here.
_handles: dict[int, tuple[Handle, Callable[[Any], Any]]] = {}
_handle_ids = itertools.count(1)
_handles_lock = threading.Lock()
# (kind, name, process set) -> handle id, for names whose completion the program has not yet seen
# (through synchronize() or a poll() that returned True).  Submitting such a name again is an error
# whether or not the first op happens to have finished already, so the outcome never depends on timing.
_unobserved: dict[tuple[int, str, int], int] = {}


class _DuplicateNameError(HoraError, ValueError):
    pass


def _forget_handles() -> None:
    """Drop every handle (at shutdown: they belong to the engine that stopped)."""
    with _handles_lock:
        _handles.clear()
        _unobserved.clear()


def _observed(hid: int, handle: Handle) -> None:
    if _unobserved.get(handle.ident) == hid:
        del _unobserved[handle.ident]


_local = threading.local()


def _now(async_fn: Callable[..., int], *args: Any, **kwargs: Any) -> Any:
    """Run an async op and wait for it; the waiting thread drives the engine itself."""
    _local.sync = True
    try:
        handle = async_fn(*args, **kwargs)
    finally:
        _local.sync = False
    return synchronize(handle)


def _register(handle: Handle, finish: Callable[[Any], Any]) -> int:
    with _handles_lock:
        hid = next(_handle_ids)
        _handles[hid] = (handle, finish)
        _unobserved[handle.ident] = hid
    return hid


def poll(handle: int) -> bool:
    """True when the async operation behind ``handle`` has finished (never blocks)."""
    with _handles_lock:
        entry = _handles.get(handle)
    if entry is None:
        raise ValueError(f"handle {handle} is unknown or was already synchronized")
    if not entry[0].done():
        runtime.current().engine.kick()
    if not entry[0].done():
        return False
    with _handles_lock:
        _observed(handle, entry[0])
    return True


def synchronize(handle: int) -> Any:
    """Wait for an async operation and return its output tensor(s).

    Raises:
        HoraError: the collective failed on this or another rank (mismatched
            shapes, shutdown, stall deadline); the message says which.
    """
    with _handles_lock:
        entry = _handles.pop(handle, None)
        if entry is not None:
            _observed(handle, entry[0])
    if entry is None:
        raise ValueError(f"handle {handle} is unknown or was already synchronized")
    engine_handle, finish = entry
    return finish(engine_handle.wait())


def _check_tensor(tensor: torch.Tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _SUPPORTED:
        raise TypeError(
            f"{what} does not support dtype {tensor.dtype}; supported: "
            + ", ".join(sorted(str(d).removeprefix("torch.") for d in _SUPPORTED))
        )
    if tensor.is_sparse:
        raise UnsupportedError(f"{what} of a sparse tensor: call .to_dense() first, or use sparse_as_dense=True")


def _resolve_op(average: bool | None, op: ReduceOp | None, default: ReduceOp = Average) -> ReduceOp:
    if average is not None and op is not None:
        raise ValueError("average and op are mutually exclusive; pass only op=")
    if op is None:
        op = default if average is None else (Average if average else Sum)
    op = ReduceOp(op)
    if op == Adasum:
        raise UnsupportedError("op=hvd.Adasum is not supported by hora yet; use hvd.Average or hvd.Sum")
    return op


def _pset_id(process_set: ProcessSet | None) -> int:
    ps = global_process_set if process_set is None else process_set
    if ps.process_set_id is None:
        raise ConfigError(f"{ps} is not registered: call hvd.add_process_set() on every rank first")
    return ps.process_set_id


def _submit(
    kind: CollectiveType, entries: list[Entry], name: str | None, *, op: ReduceOp = Sum, root: int = -1,
    prescale: float = 1.0, postscale: float = 1.0, process_set: ProcessSet | None = None,
) -> Handle:
    rt = runtime.current()
    pset = _pset_id(process_set)
    if name is not None and (int(kind), name, pset) in _unobserved:
        raise _DuplicateNameError(
            f"{kind.label} named {name!r} was submitted while an earlier {kind.label} with that name has not "
            "been synchronized yet; use a different name, or synchronize() the first handle before reusing it"
        )
    request = Request(
        name or rt.auto_name(kind.label, pset), kind, entries, process_set_id=pset, op=op, root=root,
        prescale=float(prescale), postscale=float(postscale),
    )
    if entries and entries[0].input.is_cuda:
        torch.cuda.current_stream(entries[0].input.device).synchronize()
    return rt.submit(request, wake=not getattr(_local, "sync", False))


# ------------------------------------------------------------------ allreduce
def _allreduce_entries(tensors: Sequence[torch.Tensor], inplace: bool, op: ReduceOp, what: str) -> list[Entry]:
    entries = []
    for t in tensors:
        _check_tensor(t, what)
        if t.dtype == torch.bool and op == Average:
            raise TypeError(f"{what}: op=Average is undefined for bool tensors; use Sum (any) or Min (all)")
        t = t.detach()
        entries.append(Entry(t, t if inplace else torch.empty_like(t, memory_format=torch.contiguous_format)))
    return entries


def _allreduce_handle(tensors, inplace, average, name, op, prescale_factor, postscale_factor, process_set, what):
    op = _resolve_op(average, op)
    entries = _allreduce_entries(tensors, inplace, op, what)
    return _submit(CollectiveType.ALLREDUCE, entries, name, op=op, prescale=prescale_factor,
                   postscale=postscale_factor, process_set=process_set)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> int:
    """Start averaging (or summing...) ``tensor`` across ranks; returns a handle for synchronize()."""
    h = _allreduce_handle([tensor], False, average, name, op, prescale_factor, postscale_factor, process_set,
                          "allreduce")
    return _register(h, lambda out: out[0])


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> int:
    """In-place :func:`allreduce_async`: the result overwrites ``tensor``."""
    h = _allreduce_handle([tensor], True, average, name, op, prescale_factor, postscale_factor, process_set,
                          "allreduce_")
    return _register(h, lambda out: tensor)


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks of the process set and return the result.

    Differentiable: the gradient is reduced with the same operator.
    """
    from hora.torch.autograd import HoraAllreduce
    from hora.torch.compression import Compression

    compression = compression or Compression.none
    compressed, ctx = compression.compress(tensor)
    op = _resolve_op(average, op)
    if torch.is_grad_enabled() and compressed.requires_grad:
        out = HoraAllreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    else:  # nothing to differentiate: skip the autograd node, which costs as much as a small collective
        out = _now(allreduce_async, compressed, name=name, op=op, prescale_factor=prescale_factor,
                   postscale_factor=postscale_factor, process_set=process_set)
    return compression.decompress(out, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set) -> torch.Tensor:
    """In-place :func:`allreduce`."""
    return _now(allreduce_async_, tensor, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set) -> int:
    """Reduce a list of tensors as one unit (negotiated and fused together)."""
    h = _allreduce_handle(list(tensors), False, average, name, op, prescale_factor, postscale_factor, process_set,
                          "grouped_allreduce")
    return _register(h, list)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    """In-place :func:`grouped_allreduce_async`."""
    tensors = list(tensors)
    h = _allreduce_handle(tensors, True, average, name, op, prescale_factor, postscale_factor, process_set,
                          "grouped_allreduce_")
    return _register(h, lambda out: tensors)


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set) -> list[torch.Tensor]:
    """Synchronous, differentiable :func:`grouped_allreduce_async`."""
    from hora.torch.autograd import HoraGroupedAllreduce
    from hora.torch.compression import Compression

    compression = compression or Compression.none
    pairs = [compression.compress(t) for t in tensors]
    op = _resolve_op(average, op)
    outs = HoraGroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set,
                                      *[c for c, _ in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs, strict=True)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set) -> list[torch.Tensor]:
    """In-place :func:`grouped_allreduce`."""
    return _now(grouped_allreduce_async_, tensors, average, name, op, prescale_factor, postscale_factor,
                process_set)


def sparse_allreduce_async(tensor, name=None, op=Average, process_set=global_process_set) -> Callable[[], Any]:
    """Start reducing a sparse COO tensor by allgathering its indices and values.

    Returns:
        A callable that waits and returns the reduced sparse tensor (duplicate
        indices are left uncoalesced; ``Average`` divides the values by the
        size of the process set).  Only ``Sum`` and ``Average`` are possible.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError("sparse_allreduce_async expects a sparse COO tensor; use allreduce_async for dense ones")
    op = _resolve_op(None, op)
    if op not in (Average, Sum):
        raise UnsupportedError(f"sparse_allreduce_async supports op=Average and op=Sum, not {ReduceOp(op).name}")
    base = f"{name}." if name is not None else None
    # Allgather concatenates along dim 0, so indices travel transposed: (nnz, sparse_dim).
    indices = tensor._indices().t().contiguous()
    values = tensor._values().contiguous()
    indices_handle = allgather_async(indices, name=base and base + "indices", process_set=process_set)
    values_handle = allgather_async(values, name=base and base + "values", process_set=process_set)
    size = tensor.size()

    def wait() -> torch.Tensor:
        all_values = synchronize(values_handle)
        all_indices = synchronize(indices_handle)
        if op == Average:
            all_values = all_values / _pset_size(process_set)
        return torch.sparse_coo_tensor(all_indices.t(), all_values, size, check_invariants=False)

    return wait


def _pset_size(process_set: ProcessSet | None) -> int:
    ps = global_process_set if process_set is None else process_set
    return len(ps.ranks) if ps.ranks is not None else runtime.current().engine.size


# ------------------------------------------------------------------ allgather
def _gather_entries(tensors, what) -> list[Entry]:
    entries = []
    for t in tensors:
        _check_tensor(t, what)
        if t.dim() == 0:
            raise ValueError(f"{what} needs tensors with at least one dimension (got a scalar); use t.view(1)")
        entries.append(Entry(t.detach(), None))
    return entries


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start concatenating every rank's ``tensor`` along dimension 0 (first dims may differ)."""
    h = _submit(CollectiveType.ALLGATHER, _gather_entries([tensor], "allgather"), name, process_set=process_set)
    return _register(h, lambda out: out[0])


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dimension 0; differentiable."""
    from hora.torch.autograd import HoraAllgather

    return HoraAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """Allgather a list of tensors as one unit."""
    h = _submit(CollectiveType.ALLGATHER, _gather_entries(list(tensors), "grouped_allgather"), name,
                process_set=process_set)
    return _register(h, list)


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list[torch.Tensor]:
    """Synchronous, differentiable :func:`grouped_allgather_async`."""
    from hora.torch.autograd import HoraGroupedAllgather

    return list(HoraGroupedAllgather.apply(name, process_set, *tensors))


# ------------------------------------------------------------------ broadcast
def _broadcast_handle(tensor, root_rank, name, process_set, inplace, what) -> Handle:
    _check_tensor(tensor, what)
    rt = runtime.current()
    ps = global_process_set if process_set is None else process_set
    ranks = ps.ranks if ps.ranks is not None else list(range(rt.engine.size))
    if root_rank not in ranks:
        raise ValueError(f"{what}: root_rank={root_rank} is not a rank of the process set {ranks}")
    tensor = tensor.detach()
    out = tensor if inplace else tensor.clone(memory_format=torch.contiguous_format)
    return _submit(CollectiveType.BROADCAST, [Entry(tensor, out)], name, root=int(root_rank),
                   process_set=process_set)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start copying the root's ``tensor`` to every rank (into a new tensor)."""
    return _register(_broadcast_handle(tensor, root_rank, name, process_set, False, "broadcast"),
                     lambda out: out[0])


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """In-place :func:`broadcast_async`."""
    return _register(_broadcast_handle(tensor, root_rank, name, process_set, True, "broadcast_"),
                     lambda out: tensor)


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """The root's ``tensor`` on every rank; differentiable."""
    from hora.torch.autograd import HoraBroadcast

    return HoraBroadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with the root's."""
    return _now(broadcast_async_, tensor, root_rank, name, process_set)


# ------------------------------------------------------------------- alltoall
def _splits_list(tensor: torch.Tensor, splits, n: int, what: str) -> list[int] | None:
    if tensor.dim() == 0:
        raise ValueError(f"{what} needs a tensor with at least one dimension (got a scalar); use t.view(1)")
    if splits is None:
        if tensor.shape[0] % n:
            raise ValueError(
                f"{what}: splits not given, and the first dimension ({tensor.shape[0]}) does not divide "
                f"evenly among the {n} ranks of the process set")
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 1:
            raise ValueError(f"{what} expects a 1-D splits tensor, got shape {tuple(splits.shape)}")
        if splits.is_floating_point() or splits.is_complex() or splits.dtype == torch.bool:
            raise ValueError(f"{what} expects integer splits (torch.int32), got {splits.dtype}")
        values = [int(v) for v in splits.tolist()]
    else:
        values = list(splits)
        if any(not isinstance(v, int) for v in values):
            raise ValueError(f"{what} expects integer splits, got {values}")
    if len(values) != n:
        raise ValueError(f"{what}: splits has {len(values)} entries but the process set has {n} ranks")
    if any(v < 0 for v in values) or sum(values) > tensor.shape[0]:
        raise ValueError(f"{what}: splits {values} must be non-negative and sum to at most the first "
                         f"dimension ({tensor.shape[0]})")
    return values


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start sending ``splits[i]`` rows of ``tensor`` to rank i and receiving from each.

    ``synchronize()`` returns ``(output, received_splits)``.  Rows past
    ``sum(splits)`` are not sent, as in Horovod.
    """
    _check_tensor(tensor, "alltoall")
    rt = runtime.current()
    ps = global_process_set if process_set is None else process_set
    n = len(ps.ranks) if ps.ranks is not None else rt.engine.size
    values = _splits_list(tensor, splits, n, "alltoall")
    source = tensor.detach()
    if values is not None and sum(values) < source.shape[0]:
        source = source[: sum(values)]
    h = _submit(CollectiveType.ALLTOALL, [Entry(source, None, values)], name, process_set=process_set)
    return _register(h, lambda out: out[0])


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Scatter rows of ``tensor`` to all ranks and gather theirs; differentiable.

    Returns:
        The gathered output when ``splits`` is None (equal split), else
        ``(output, received_splits)``, as Horovod does.
    """
    from hora.torch.autograd import HoraAlltoall

    output, received = HoraAlltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# -------------------------------------------------------------- reducescatter
def _reducescatter_handle(tensors, name, op, process_set, prescale_factor, postscale_factor, what) -> Handle:
    op = _resolve_op(None, op)
    if op not in (Average, Sum):
        raise UnsupportedError(f"{what} supports op=Average and op=Sum, not {ReduceOp(op).name}")
    entries = []
    for t in tensors:
        _check_tensor(t, what)
        if t.dim() == 0:
            raise ValueError(f"{what} needs tensors with at least one dimension")
        entries.append(Entry(t.detach(), None))
    return _submit(CollectiveType.REDUCESCATTER, entries, name, op=op, prescale=prescale_factor,
                   postscale=postscale_factor, process_set=process_set)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> int:
    """Start reducing ``tensor`` and scattering dimension 0: rank i keeps block i."""
    h = _reducescatter_handle([tensor], name, op, process_set, prescale_factor, postscale_factor, "reducescatter")
    return _register(h, lambda out: out[0])


def reducescatter(tensor, name=None, compression=None, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0) -> torch.Tensor:
    """Reduce ``tensor`` across ranks and return this rank's block of rows; differentiable."""
    from hora.torch.autograd import HoraReducescatter
    from hora.torch.compression import Compression

    compression = compression or Compression.none
    compressed, ctx = compression.compress(tensor)
    out = HoraReducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    """Reducescatter a list of tensors as one unit."""
    h = _reducescatter_handle(list(tensors), name, op, process_set, prescale_factor, postscale_factor,
                              "grouped_reducescatter")
    return _register(h, list)


def grouped_reducescatter(tensors, name=None, compression=None, op=Average, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0) -> list[torch.Tensor]:
    """Synchronous, differentiable :func:`grouped_reducescatter_async`."""
    from hora.torch.autograd import HoraGroupedReducescatter
    from hora.torch.compression import Compression

    compression = compression or Compression.none
    pairs = [compression.compress(t) for t in tensors]
    outs = HoraGroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                          *[c for c, _ in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs, strict=True)]


# -------------------------------------------------------------------- control
def barrier(process_set=global_process_set) -> None:
    """Block until every rank of the process set reaches the barrier."""
    _local.sync = True
    try:
        handle = _submit(CollectiveType.BARRIER, [], None, process_set=process_set)
    finally:
        _local.sync = False
    handle.wait()


def join(device: int = -1) -> int:
    """Declare that this rank has no more data; keep serving others' allreduces with zeros.

    Blocks until every rank has joined.  Ranks with fewer batches call it
    early, so uneven data never hangs the job.

    Returns:
        The rank that joined last.
    """
    rt = runtime.current()
    request = Request(rt.auto_name("join"), CollectiveType.JOIN, [])
    return int(rt.submit(request, wake=False).wait())
